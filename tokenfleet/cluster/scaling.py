"""Scaling the fleet by hand, and draining a replica before it stops: one FleetClient's
Scaler (the client routes and moves requests; this decides which replicas come and go).

    scale(N) ─┬─ more:  a replica this gateway drains goes back to ready, else a new id
              │         (the lowest free) ──▶ starting ──▶ ready (routable once warmed up)
              └─ fewer: down ones first (dead or fenced, Ray bringing them back: gone at
                        once, their requests moved already), then starting ones, then the
                        highest ids ──▶ draining ──▶ gone

The fleet's size counts replicas starting or ready, and those down that Ray is bringing
back (a restart, a replacement): a scale while one is down adds none for it. One that Ray
gave up on (its restarts used up) is not counted, so a scale to the same size replaces it.

    draining   no new work: not routable here, and flagged on the replica itself, so that
      │        every gateway sees it (Directory.describe) and sends it nothing either
      │        its requests end on it ........................... within the grace period
      │        grace over: each gateway moves the rest of its own to other replicas, as on a
      │        death (a new attempt, with the tokens received: what the replica still sends
      ▼        of the old attempt is dropped)
    gone       the gateway that asked stops it (Directory.remove) once its reports show no
               request of any gateway left (and not before FOLLOWED_S: every gateway has
               read the flag), or the grace plus SETTLE_S is over

A draining replica that dies is gone at once (its requests move as on any death). A
moved drain does not count against a request's `max_moves`: nothing went wrong. The time
from drain to gone is each drain's `seconds` (GET /admin/fleet, and /metrics).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenfleet.cluster.links import DOWN
from tokenfleet.cluster.placement import ReplicaDescription
from tokenfleet.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenfleet.cluster.client import FleetClient
    from tokenfleet.cluster.links import ReplicaLink

logger = logging.getLogger(__name__)

MAX_REPLICAS = 1024
# After the grace: time for other gateways (which learn of the drain a discovery round
# later) to move their requests, and for the aborts to reach the replica.
SETTLE_S = 5.0
# A drain lasts this long at least: other gateways read the flag within a discovery round
# (about 0.5 s) and follow the drain; one that saw the replica die first would keep it as a
# dead replica rather than gone.
FOLLOWED_S = 2.0
COUNTED = ("starting", "ready")  # the states that make up the fleet's size
NUM_ENDED_KEPT = 32


@dataclass
class Drain:
    replica_id: int
    started_at: float  # time.monotonic()
    grace_s: float
    owner: bool  # this gateway asked for it, and stops the replica
    num_moved: int = 0  # this gateway's requests moved off it after the grace
    reports_when_empty: int | None = None  # the link's report count once ours were gone
    ended_at: float | None = None
    # then "stopped", "died", "cancelled", or "down" (scaled away while down: stopped at once)
    outcome: str = "draining"

    def seconds(self, now: float) -> float:
        return (self.ended_at if self.ended_at is not None else now) - self.started_at

    def describe(self, now: float) -> dict[str, object]:
        return {
            "id": self.replica_id,
            "state": self.outcome,
            "seconds": round(self.seconds(now), 3),
            "moved": self.num_moved,
            "grace_s": self.grace_s,
            "asked_here": self.owner,
        }


class Scaler:
    def __init__(self, client: FleetClient, grace_s: float = 30.0) -> None:
        if grace_s < 0:
            raise ValueError(f"the drain grace must be at least 0 s, got {grace_s}")
        self.client = client
        self.grace_s = grace_s
        self.target: int | None = None  # the last size asked for here
        self.drains: dict[int, Drain] = {}  # in progress, by replica id
        self.ended: deque[Drain] = deque(maxlen=NUM_ENDED_KEPT)
        self.num_drained = 0  # drains that ended with the replica gone (stopped or died)
        self.drain_seconds_sum = 0.0  # over those
        self.num_drain_moves = 0
        self._flags: dict[int, bool] = {}  # the draining flag each replica last showed
        # Flags this gateway writes: how many writes run, and the directory read under way
        # when the last one ended. A read made before a write of ours landed shows the old
        # flag: not another gateway's drain (or cancel) to follow.
        self._writing: dict[int, int] = {}
        self._landed: dict[int, int] = {}
        # Replicas gone: the incarnations they had. Ray's answers about them (one in flight
        # when they stopped, "dead" from a cached handle) are ignored, until a scale-up
        # starts the id again as a new incarnation.
        self._gone: dict[int, set[int]] = {}

    # -- asked by the operator ----------------------------------------------------------

    def size(self) -> int:
        """Replicas starting or ready, and those dead or fenced that Ray is bringing back
        (a restart, a replacement asked for): a scale while one is down does not add one
        more for it. One Ray gave up on is not counted: a scale to the same size replaces
        it."""
        return sum(
            link.state in COUNTED or (link.state in DOWN and not link.given_up)
            for link in self.client.links.values()
        )

    def scale(self, num_replicas: int) -> dict[str, object]:
        """Aim for `num_replicas` replicas starting or ready; returns what changes."""
        if isinstance(num_replicas, bool) or not 1 <= num_replicas <= MAX_REPLICAS:
            raise InvalidRequestError(
                f"replicas: must be an integer from 1 to {MAX_REPLICAS}, got {num_replicas!r}",
                param="replicas",
            )
        self.target = num_replicas
        size = self.size()
        kept: list[int] = []
        added: list[int] = []
        draining: list[int] = []
        if num_replicas > size:
            ours = sorted(i for i, drain in self.drains.items() if drain.owner)
            kept = ours[: num_replicas - size]
            for replica_id in kept:
                self._cancel(self.drains[replica_id], tell_replica=True)
            added = self._free_ids(num_replicas - size - len(kept))
            for replica_id in added:
                self._gone.pop(replica_id, None)
                self.client.add_link(replica_id)
                self._call(self.client.directory.add, replica_id)
        elif num_replicas < size:
            # Those down first (stopped at once: their requests have moved), then those
            # starting, then the highest ids.
            links = self.client.links.values()
            down = [link for link in links if link.state in DOWN and not link.given_up]
            counted = [link for link in links if link.state in COUNTED]
            counted.sort(key=lambda link: (link.state != "starting", -link.replica_id))
            for link in [*down, *counted][: size - num_replicas]:
                if link.state in DOWN:
                    self._end(Drain(link.replica_id, time.monotonic(), 0.0, True), link, "down")
                else:
                    self._drain(link, owner=True)
                draining.append(link.replica_id)
        logger.info(
            "scale to %d replicas: %d added %s, %d kept %s, %d draining %s",
            num_replicas,
            len(added),
            added,
            len(kept),
            kept,
            len(draining),
            draining,
        )
        return {"replicas": num_replicas, "added": added, "kept": kept, "draining": draining}

    def _free_ids(self, count: int) -> list[int]:
        ids: list[int] = []
        replica_id = 0
        while len(ids) < count:
            if replica_id not in self.client.links:
                ids.append(replica_id)
            replica_id += 1
        return ids

    # -- what the directory and the links say ---------------------------------------------

    def ignores(self, replica_id: int, found: ReplicaDescription | str) -> bool:
        """Whether a description is of a replica gone (an old answer): ignored."""
        gone = self._gone.get(replica_id)
        if gone is None:
            return False
        if isinstance(found, ReplicaDescription) and found.incarnation not in gone:
            del self._gone[replica_id]  # started again (a scale-up, here or elsewhere)
            return False
        return True

    def follow(self, link: ReplicaLink, draining: bool) -> None:
        """The replica's own flag, as the directory describes it: a drain another gateway
        asked for (or cancelled) is followed here."""
        replica_id = link.replica_id
        if self._writing.get(replica_id):
            return  # read while our own write runs
        if replica_id in self._landed:
            if self.client.watch.discover_round <= self._landed[replica_id]:
                return  # read before our own write landed
            del self._landed[replica_id]
        if self._flags.get(link.replica_id, False) == draining:
            return
        self._flags[link.replica_id] = draining
        drain = self.drains.get(link.replica_id)
        if draining and drain is None and link.state in COUNTED:
            self._drain(link, owner=False)
        elif not draining and drain is not None and not drain.owner:
            self._cancel(drain, tell_replica=False)

    def died(self, link: ReplicaLink) -> None:
        """The link's replica is dead to this gateway (its requests moved): if it was
        draining, it is gone."""
        drain = self.drains.get(link.replica_id)
        if drain is not None:
            self._end(drain, link, "died")

    def tick(self, now: float) -> None:
        """One round (the client's watchdog's): drains move on."""
        for drain in list(self.drains.values()):
            link = self.client.links.get(drain.replica_id)
            if link is None:  # (dropped elsewhere)
                del self.drains[drain.replica_id]
                continue
            if link.requests:
                if now - drain.started_at >= drain.grace_s:
                    why = f"replica {drain.replica_id} drains, its {drain.grace_s:g} s grace over"
                    moved = self.client.move_all(link, why)
                    drain.num_moved += moved
                    self.num_drain_moves += moved
                continue
            if not drain.owner:
                continue  # the gateway that asked stops it
            if drain.reports_when_empty is None:
                drain.reports_when_empty = link.num_reports
            stats = link.stats
            # Two reports after ours were gone: the aborts of moved requests are in them.
            idle = link.info is None or stats is None
            idle = idle or (
                link.num_reports >= drain.reports_when_empty + 2
                and stats is not None
                and stats.num_running + stats.num_waiting == 0
            )
            idle = idle and now - drain.started_at >= FOLLOWED_S
            if idle or now - drain.started_at >= drain.grace_s + SETTLE_S:
                self._end(drain, link, "stopped")

    # -- the drain's steps ----------------------------------------------------------------

    def _drain(self, link: ReplicaLink, *, owner: bool) -> None:
        link.state = "draining"
        self.drains[link.replica_id] = Drain(link.replica_id, time.monotonic(), self.grace_s, owner)
        logger.info(
            "replica %d drains (%s; %d requests of this gateway on it)",
            link.replica_id,
            "asked here" if owner else "asked by another gateway",
            len(link.requests),
        )
        if owner:
            self._write_flag(link.replica_id, True)
        if not self.client.is_healthy():
            self.client.unready()

    def _cancel(self, drain: Drain, *, tell_replica: bool) -> None:
        link = self.client.links[drain.replica_id]
        self._finish(drain, "cancelled")
        if tell_replica:
            self._write_flag(link.replica_id, False)
        logger.info("replica %d drains no more", link.replica_id)
        if link.info is not None and link.socket is not None:
            self.client.mark_ready(link)
        else:
            link.state = "starting"

    def _end(self, drain: Drain, link: ReplicaLink, outcome: str) -> None:
        """The replica leaves this gateway's fleet; stopped for good if asked here."""
        self._finish(drain, outcome)
        self.num_drained += 1
        self.drain_seconds_sum += drain.seconds(time.monotonic())
        incarnations = set(link.fenced)
        if link.incarnation is not None:
            incarnations.add(link.incarnation)
        self._gone[link.replica_id] = incarnations
        self._flags.pop(link.replica_id, None)
        self.client.drop_link(link)
        if drain.owner:
            self._call(self.client.directory.remove, link.replica_id)
        logger.info(
            "replica %d gone (%s) after a drain of %.2f s, %d requests moved",
            link.replica_id,
            outcome,
            drain.seconds(time.monotonic()),
            drain.num_moved,
        )

    def _finish(self, drain: Drain, outcome: str) -> None:
        drain.ended_at, drain.outcome = time.monotonic(), outcome
        self.drains.pop(drain.replica_id, None)
        self.ended.append(drain)

    def _write_flag(self, replica_id: int, draining: bool) -> None:
        """Set the replica's draining flag in the directory, for every gateway to follow."""
        self._flags[replica_id] = draining
        self._writing[replica_id] = self._writing.get(replica_id, 0) + 1

        def landed() -> None:
            self._writing[replica_id] -= 1
            self._landed[replica_id] = self.client.watch.discover_round

        self._call(self.client.directory.set_draining, replica_id, draining, then=landed)

    def _call(
        self, method: Callable[..., None], *args: object, then: Callable[[], None] | None = None
    ) -> None:
        """A directory call (blocking: Ray) in a thread, its failure logged."""

        async def run() -> None:
            try:
                await asyncio.to_thread(method, *args)
            except Exception:
                logger.exception("the fleet's directory failed %s%r", method.__name__, args)
            if then is not None:
                then()

        self.client.spawn(run())

    def describe(self) -> dict[str, object]:
        """The scaling part of GET /admin/fleet."""
        now = time.monotonic()
        return {
            "target_replicas": self.target,
            "drain_grace_s": self.grace_s,
            "drains": [d.describe(now) for d in [*self.ended, *self.drains.values()]],
        }
