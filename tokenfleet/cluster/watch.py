"""Finding and hearing the replicas of a gateway's fleet: the directory's reads and the
watchdog, for cluster/client.py's FleetClient.

- **Finding**: every `discover_interval_s` the directory (Ray, by name) is asked for each
  replica's incarnation and address; a new incarnation is connected to and the old one
  taken for dead (its requests move), a replica Ray reports dead or restarting is dead.
- **Hearing**: each replica's bridge beats every 0.2 s from a thread of its own (a long
  step is not a silence). Silent past `replica_timeout_s`: its requests move and it gets
  no new work, but it serves again if it speaks. Silent past `fence_timeout_s`: fenced
  (its incarnation too: whatever it sends later is dropped and counted) and Ray is asked
  to replace it, since Ray never notices a frozen actor. A closed connection that stays
  closed `DISCONNECT_GRACE_S` is a death. A starting replica (loading its model) is
  judged by the start-up timeout instead.
- **Slow**: each beat is one window of health.py's slow rule.

What a death does to the requests (moving them) is the client's; this module decides when
a replica is dead, silent, fenced or slow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from tokenfleet.cluster.links import DOWN, ReplicaLink
from tokenfleet.cluster.placement import ReplicaDescription

if TYPE_CHECKING:
    from tokenfleet.cluster.client import FleetClient

logger = logging.getLogger(__name__)

# A replica whose connection closed and has not connected again this long after is dead
# (a killed process's port refuses at once; a network blip reconnects within it).
DISCONNECT_GRACE_S = 0.5
DEFAULT_FENCE_TIMEOUT_S = 10.0
PING_EVERY_S = 0.5
ROUND_S = 0.1
LATE_ROUND_S = 0.35  # a round this long after the last: the loop was blocked


class Directory(Protocol):
    """Where the replicas are: Ray (placement.RayFleet), or a fixed list in tests."""

    def start(self) -> None: ...

    async def describe(self, timeout_s: float) -> dict[int, ReplicaDescription | str]: ...

    def restart(self, replica_id: int) -> None:
        """Have the replica replaced: it still runs, but this gateway took it for dead
        (frozen, cut off). Ray notices neither by itself."""
        ...

    def add(self, replica_id: int) -> None:
        """Start a replica of this id (a scale-up)."""
        ...

    def set_draining(self, replica_id: int, draining: bool) -> None:
        """Flag the replica draining or not; `describe` shows the flag to every gateway."""
        ...

    def remove(self, replica_id: int) -> None:
        """Stop the replica for good (drained); `describe` no longer lists it."""
        ...

    def shutdown(self) -> None: ...


class ReplicaWatch:
    """The discovery loop and the watchdog of one FleetClient (module doc)."""

    def __init__(self, client: FleetClient) -> None:
        self.client = client
        self.discover_round = 0  # counts the directory's reads, each before it is made

    # -- finding ---------------------------------------------------------------------

    async def discover_loop(self) -> None:
        client = self.client
        while True:
            self.discover_round += 1
            try:
                found = await client.directory.describe(max(1.0, client.replica_timeout_s))
            except Exception:
                logger.exception("the fleet's directory could not be read")
                found = {}
            for replica_id, description in found.items():
                self.discovered(replica_id, description)
            await asyncio.sleep(client.discover_interval_s)

    def discovered(self, replica_id: int, found: ReplicaDescription | str) -> None:
        client = self.client
        if client.scaler.ignores(replica_id, found):
            return
        link = client.links.get(replica_id) or client.add_link(replica_id)
        if isinstance(found, str):
            link.given_up = link.given_up or found == "dead"
            if found in ("dead", "restarting") and link.state not in DOWN:
                client.replica_dead(link, f"Ray reports it {found}")
            return
        if found.incarnation in link.fenced:
            # Declared dead, still running (frozen, cut off, or only slow): replace it,
            # once; its requests have moved, and whatever it sends is dropped.
            if found.incarnation not in link.restart_asked:
                link.restart_asked.add(found.incarnation)
                logger.warning("replica %d: asking Ray to replace it", replica_id)
                client.spawn(self._replace(replica_id))
            return
        if found.incarnation == link.incarnation:
            client.scaler.follow(link, found.draining)
            return
        if link.incarnation is not None:
            client.replica_dead(link, "it has a new incarnation")
            if replica_id not in client.links:
                return  # it was draining: gone
        if link.fenced or link.incarnation is not None:
            link.restarts += 1
            client.num_restarts += 1
        link.incarnation, link.given_up = found.incarnation, False
        link.address, link.node, link.pid = found.address, found.node, found.pid
        link.state, link.info, link.beat = "starting", None, None
        link.silent_since, link.slow = None, False
        client.health.forget(replica_id)
        client.connect(link)
        logger.info("replica %d incarnation %d at %s", replica_id, found.incarnation, link.address)
        client.scaler.follow(link, found.draining)

    async def _replace(self, replica_id: int) -> None:
        try:
            await asyncio.to_thread(self.client.directory.restart, replica_id)
        except Exception:  # logged; the next fence (a new incarnation's) asks again
            logger.exception("replica %d could not be replaced", replica_id)

    # -- hearing ---------------------------------------------------------------------

    async def watchdog(self, ping: bytes) -> None:
        next_ping = 0.0
        last_round = time.monotonic()
        while True:
            await asyncio.sleep(ROUND_S)
            # This loop woke late (it was blocked): what the replicas sent meanwhile is
            # still unread, so no silence is judged this round.
            now = time.monotonic()
            late = now - last_round > LATE_ROUND_S
            last_round = now
            try:
                next_ping = self.watch(ping, next_ping, late)
            except Exception:  # a bug here must not end the watch over every replica
                logger.exception("the fleet watchdog failed a round")

    def watch(self, ping: bytes, next_ping: float, late: bool) -> float:
        """One round of the watchdog: pings out, silent replicas dead, parked requests
        placed; returns when to ping next."""
        client = self.client
        now = time.monotonic()
        if now >= next_ping:
            next_ping = now + PING_EVERY_S
            for link in client.links.values():
                link.send(ping)
        else:
            # A new connection takes a moment: a replica not yet heard from is pinged every
            # round, so that it learns of this gateway (and beats) at once.
            for link in client.links.values():
                if link.beat is None and link.state == "starting":
                    link.send(ping)
        for link in list(client.links.values()):
            if link.socket is None or link.state in DOWN:
                continue
            link.check_connection(now)
            silence = link.silent_for(now)
            closed = link.disconnected_at
            if closed is not None and now - closed > DISCONNECT_GRACE_S:
                # Not a silence: a late loop changes nothing (messages sent before it
                # closed say nothing of after).
                client.replica_dead(link, f"its connection closed {now - closed:.1f} s ago")
            elif late:
                continue
            elif link.state == "starting" and link.info is None:
                # Loading its model (16 replicas loading at once starve each other's beats):
                # judged by the start-up timeout.
                if silence > client.startup_timeout_s:
                    client.replica_dead(link, f"silent for {silence:.0f} s while starting")
            elif silence > client.fence_timeout_s:
                self._fence(link, silence)
            elif silence > client.replica_timeout_s and link.silent_since is None:
                self._silent(link, silence, now)
        client.scaler.tick(now)
        client.unpark()
        return next_ping

    def _silent(self, link: ReplicaLink, silence: float, now: float) -> None:
        """Silent past the replica timeout: its requests move, no new work; not fenced
        yet (a replica that speaks again serves again)."""
        link.silent_since = now
        logger.warning(
            "replica %d silent for %.1f s: its %d requests move, no new work until it speaks",
            link.replica_id,
            silence,
            len(link.requests),
        )
        if not self.client.is_healthy():
            self.client.unready()
        self.client.move_off(link, f"silent for {silence:.1f} s")

    def _fence(self, link: ReplicaLink, silence: float) -> None:
        """Silent past the fence timeout (frozen, cut off): nothing more is taken from
        this incarnation, and Ray, which never notices a frozen actor, is asked to
        replace it."""
        incarnation = link.incarnation
        self.client.replica_dead(link, f"silent for {silence:.1f} s", state="fenced")
        self.client.health.num_fenced += 1
        if incarnation is not None and incarnation not in link.restart_asked:
            link.restart_asked.add(incarnation)
            logger.warning("replica %d: fenced, asking Ray to replace it", link.replica_id)
            self.client.spawn(self._replace(link.replica_id))

    def heard(self, link: ReplicaLink, now: float) -> None:
        """A message from the replica's current incarnation: a silent one serves again."""
        link.last_heard = now
        if link.silent_since is None:
            return
        logger.warning(
            "replica %d speaks again after %.1f s silent: it serves again",
            link.replica_id,
            now - link.silent_since,
        )
        link.silent_since = None
        self.client.health.forget(link.replica_id)  # measured anew (the bridge drops the stall)
        link.slow = False
        if link.state == "ready":
            self.client.mark_ready(link)

    def windowed(self, link: ReplicaLink, step_ms: float | None) -> None:
        """A beat: one window of the slow rule."""
        health = self.client.health
        became = health.window(link.replica_id, step_ms)
        link.slow = health.is_slow(link.replica_id)
        if became is not None:
            one = health.replicas.get(link.replica_id)
            logger.warning(
                "replica %d %s: step %s ms on average, the others' median %s ms",
                link.replica_id,
                "is slow: no new work" if became else "is no longer slow",
                f"{one.average_ms:.1f}" if one and one.average_ms is not None else "-",
                f"{one.median_ms:.1f}" if one and one.median_ms is not None else "-",
            )
