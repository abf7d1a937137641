"""Picks a replica for each interactive request: prefix affinity, else least loaded.

The router keeps its own view, as a gateway would: which replicas it sent each prompt
prefix to (the engine's chained block hashes, kv_cache.compute_block_hashes, of the first
`affinity_blocks` full blocks; a bounded LRU map), and per replica the requests it sent
that have not finished and the prompt tokens not yet prefilled. A replica's score is

    uncached prompt tokens  +  queued prefill tokens  +  decode_weight x running requests

where uncached = the prompt less the blocks the replica is believed to hold. Affinity
gives way to balance: a replica with more than `max_imbalance` requests over the least
loaded one is not a candidate. Ties go to the lowest replica id (deterministic).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenfleet.core.kv_cache import compute_block_hashes


@dataclass(frozen=True)
class RouterConfig:
    affinity: bool = True
    affinity_blocks: int = 64
    decode_weight: float = 16.0
    max_imbalance: int = 8
    max_entries: int = 200_000


@dataclass
class ReplicaView:
    """What the router knows of one replica from what it sent it."""

    num_requests: int = 0
    queued_prefill_tokens: int = 0


@dataclass
class Router:
    config: RouterConfig
    block_size: int
    views: dict[int, ReplicaView] = field(default_factory=dict)
    _holders: OrderedDict[int, set[int]] = field(default_factory=OrderedDict)

    def add_replica(self, replica_id: int) -> None:
        self.views[replica_id] = ReplicaView()

    def remove_replica(self, replica_id: int) -> None:
        """Stop routing to it (drained); its prefix entries are dropped as they come up."""
        self.views.pop(replica_id, None)

    def route(self, prompt: Sequence[int], candidates: Sequence[int]) -> tuple[int, int]:
        """The replica (one of `candidates`) for a request with this prompt, and the
        prompt tokens it is believed to have to prefill (to pass to `prefilled`)."""
        assert candidates, "no replica to route to"
        hashes = self._hashes(prompt)
        least = min(self.views[r].num_requests for r in candidates)
        best, best_score, best_uncached = candidates[0], float("inf"), len(prompt)
        for replica_id in candidates:
            view = self.views[replica_id]
            if view.num_requests > least + self.config.max_imbalance:
                continue
            cached = self._cached_blocks(hashes, replica_id) * self.block_size
            uncached = max(len(prompt) - cached, 0)
            score = (
                uncached
                + view.queued_prefill_tokens
                + self.config.decode_weight * view.num_requests
            )
            if score < best_score:
                best, best_score, best_uncached = replica_id, score, uncached
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

    def _hashes(self, prompt: Sequence[int]) -> list[int]:
        if not self.config.affinity:
            return []
        head = prompt[: self.config.affinity_blocks * self.block_size]
        return compute_block_hashes(head, self.block_size)

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
