"""Picks a replica for each interactive request: prefix affinity, else least loaded. One
class for the simulator and the live fleet (cluster/client.py).

The router keeps its own view, as a gateway would: which replicas it sent each prompt
prefix to (the engine's chained block hashes, kv_cache.compute_block_hashes, salted by
the request's key group as the engine salts them, of the first `affinity_blocks` full
blocks; a bounded LRU map), and per replica the requests it sent that have not finished
and the prompt tokens not yet prefilled. An approximate map rather than the replicas'
own cache events: nothing more crosses the wire per step, and a prefix this router sent
somewhere is where it went (an eviction it does not see costs one cache miss, priced as
a miss would be). With several gateways each sees its own share of the traffic; the load
term also counts what the replica reports (`report`), every gateway's requests. A
replica's score is

    uncached prompt tokens  +  queued prefill tokens  +  decode_weight x requests

where uncached = the prompt less the blocks the replica is believed to hold, and requests
the larger of those this router sent and those the replica last reported. Affinity gives
way to balance: a replica with more than `max_imbalance` requests over the least loaded
one is not a candidate; and to latency: given `meets_target`, a replica predicted to miss
the TTFT target is passed over while another meets it. Ties go to the lowest replica id
(deterministic). `policy` "least_loaded" scores without the prefix term, "round_robin"
takes the candidates in turn (the router benchmark's baselines).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenfleet.core.kv_cache import compute_block_hashes


@dataclass(frozen=True)
class RouterConfig:
    affinity: bool = True
    affinity_blocks: int = 64
    decode_weight: float = 16.0
    max_imbalance: int = 8
    max_entries: int = 200_000
    policy: str = "prefix"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {self.policy!r}")


POLICIES = ("prefix", "least_loaded", "round_robin")


@dataclass
class ReplicaView:
    """What the router knows of one replica: from what it sent it, and what the replica
    last reported (its running and waiting requests, every gateway's)."""

    num_requests: int = 0
    queued_prefill_tokens: int = 0
    reported_requests: int = 0

    @property
    def load(self) -> int:
        return max(self.num_requests, self.reported_requests)


@dataclass
class Router:
    config: RouterConfig
    block_size: int
    views: dict[int, ReplicaView] = field(default_factory=dict)
    _holders: OrderedDict[int, set[int]] = field(default_factory=OrderedDict)
    _turn: int = 0

    def add_replica(self, replica_id: int) -> None:
        self.views[replica_id] = ReplicaView()

    def remove_replica(self, replica_id: int) -> None:
        """Stop routing to it (drained); its prefix entries are dropped as they come up."""
        self.views.pop(replica_id, None)

    def report(self, replica_id: int, num_requests: int) -> None:
        """The replica's own count of its running and waiting requests (all gateways')."""
        view = self.views.get(replica_id)
        if view is not None:
            view.reported_requests = num_requests

    def route(
        self,
        prompt: Sequence[int],
        candidates: Sequence[int],
        cache_salt: str | None = None,
        meets_target: Callable[[int, int], bool] | None = None,
    ) -> tuple[int, int]:
        """The replica (one of `candidates`) for a request with this prompt, and the
        prompt tokens it is believed to have to prefill (to pass to `prefilled`).
        `cache_salt`: the request's (its key group), salting the hashes as the engine
        does, so that two groups' equal prompts are not taken for one cached prefix.
        `meets_target(replica, uncached tokens)`: whether the replica is predicted to give
        the first token within the TTFT target."""
        assert candidates, "no replica to route to"
        if self.config.policy == "round_robin":
            self._turn += 1
            best = sorted(candidates)[self._turn % len(candidates)]
            return self._routed(best, len(prompt), [])
        prefix = self.config.policy == "prefix" and self.config.affinity
        hashes = self._hashes(prompt, cache_salt) if prefix else []
        scored = []
        for replica_id in candidates:
            view = self.views[replica_id]
            cached = self._cached_blocks(hashes, replica_id) * self.block_size
            uncached = max(len(prompt) - cached, 0)
            score = uncached + view.queued_prefill_tokens + self.config.decode_weight * view.load
            scored.append((score, replica_id, uncached))
        least = min(self.views[r].load for r in candidates)
        limit = least + self.config.max_imbalance
        options = [o for o in scored if self.views[o[1]].load <= limit]
        if meets_target is not None:
            # Those that meet the target; if balance kept them all out, any that does.
            fine = [o for o in options if meets_target(o[1], o[2])]
            fine = fine or [o for o in scored if meets_target(o[1], o[2])]
            options = fine or options
        _, best, uncached = min(options)
        return self._routed(best, uncached, hashes)

    def _routed(self, best: int, best_uncached: int, hashes: list[int]) -> tuple[int, int]:
        self._remember(hashes, best)
        view = self.views[best]
        view.num_requests += 1
        view.queued_prefill_tokens += best_uncached
        return best, best_uncached

    def prefilled(self, replica_id: int, num_tokens: int) -> None:
        """The replica sampled the first token of a request routed with `num_tokens` to
        prefill."""
        view = self.views.get(replica_id)
        if view is not None:
            view.queued_prefill_tokens -= num_tokens

    def finished(self, replica_id: int) -> None:
        view = self.views.get(replica_id)
        if view is not None:
            view.num_requests -= 1

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(v.queued_prefill_tokens for v in self.views.values())

    def _hashes(self, prompt: Sequence[int], cache_salt: str | None = None) -> list[int]:
        if not self.config.affinity:
            return []
        head = prompt[: self.config.affinity_blocks * self.block_size]
        return compute_block_hashes(head, self.block_size, cache_salt=cache_salt)

    def _cached_blocks(self, hashes: list[int], replica_id: int) -> int:
        num = 0
        for block_hash in hashes:
            holders = self._holders.get(block_hash)
            if holders is None or replica_id not in holders:
                break
            num += 1
        return num

    def _remember(self, hashes: list[int], replica_id: int) -> None:
        for block_hash in hashes:
            holders = self._holders.get(block_hash)
            if holders is None:
                holders = self._holders[block_hash] = set()
            else:
                self._holders.move_to_end(block_hash)
            holders.add(replica_id)
        while len(self._holders) > self.config.max_entries:
            self._holders.popitem(last=False)
