"""The gateway's connection to one replica: a DEALER socket with the gateway's identity (it
only sends: replies come to the gateway's one PULL socket, wire.py), the replica's latest
beat, and its state as this gateway sees it.

States: "starting" (connected, model loading), "ready" (routable), "draining" (scaled
away: no new work, its requests end or move, then it is gone: scaling.py), "dead" (its
connection closed, or Ray says it is down), "fenced" (silent past the fence timeout:
frozen or cut off, and Ray asked to replace it). Dead or fenced, its incarnation is fenced:
nothing more from it is taken, and a replica comes back only as a new incarnation.

Two conditions of a ready replica are flags beside the state (the scaler counts it as
ready meanwhile), shown as its state in GET /admin/fleet: "silent" (nothing heard for the
replica timeout: its requests moved, no new work; it serves again if it speaks before the
fence timeout) and "slow" (health.py: no new work while another replica is ready).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from tokenfleet.cluster.wire import ReplicaBeat
from tokenfleet.core.engine_api import SchedulerStats
from tokenfleet.engine.wire import EngineReady

STATES = ("starting", "ready", "draining", "silent", "slow", "fenced", "dead")
DOWN = ("dead", "fenced")  # its incarnation fenced; back only as a new one


@dataclass
class ReplicaLink:
    replica_id: int
    state: str = "starting"
    incarnation: int | None = None  # the one this gateway takes messages from
    fenced: set[int] = field(default_factory=set)  # incarnations declared dead
    restart_asked: set[int] = field(default_factory=set)  # fenced ones Ray was asked to replace
    address: str = ""
    node: str = ""
    pid: int | None = None
    socket: zmq.Socket[bytes] | None = None
    info: EngineReady | None = None
    beat: ReplicaBeat | None = None
    stats: SchedulerStats | None = None
    last_heard: float = 0.0
    restarts: int = 0  # new incarnations seen after the first
    requests: set[str] = field(default_factory=set)  # this gateway's requests on it
    num_batch: int = 0  # of those, batch requests
    # Interactive prompts sent lately, (reports seen when sent, uncached tokens): ahead in
    # its queue until a report surely counts them (`reported`).
    unreported: list[tuple[int, int]] = field(default_factory=list)
    num_reports: int = 0
    # When the connection to it closed (its process died, or the network broke), until it
    # connects again; None while connected.
    disconnected_at: float | None = None
    monitor: zmq.Socket[bytes] | None = None
    silent_since: float | None = None  # silent past the replica timeout, since then
    slow: bool = False  # health.py's verdict
    num_routed: int = 0  # requests (and moved attempts) this gateway sent it
    # Ray reported it dead for good (its restarts used up): it will not come back, so it is
    # no longer part of the fleet's size.
    given_up: bool = False

    @property
    def routable(self) -> bool:
        return self.state == "ready" and self.socket is not None and self.silent_since is None

    @property
    def shown_state(self) -> str:
        if self.state == "ready" and self.silent_since is not None:
            return "silent"
        if self.state == "ready" and self.slow:
            return "slow"
        return self.state

    def connect(self, ctx: zmq.Context[zmq.Socket[bytes]], identity: bytes) -> None:
        self.close()
        socket = ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, identity)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 100_000)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer not connected
        # The kernel closes a dead process's connections at once: a disconnect says in
        # milliseconds what silence says only after the replica timeout.
        self.monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        socket.connect(self.address)
        self.socket = socket
        self.last_heard = time.monotonic()
        self.disconnected_at = None

    def close(self) -> None:
        self.unreported.clear()
        if self.socket is not None:
            if self.monitor is not None:
                self.socket.disable_monitor()
                self.monitor.close(linger=0)
                self.monitor = None
            self.socket.close(linger=0)
            self.socket = None

    def check_connection(self, now: float) -> None:
        """Follow the socket's connection to the replica since the last look."""
        while self.monitor is not None:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self.disconnected_at = None
            elif self.disconnected_at is None:
                self.disconnected_at = now

    def silent_for(self, now: float) -> float:
        return now - self.last_heard

    @property
    def ahead(self) -> list[int]:
        """The prompts this gateway sent that its last report may not count yet."""
        return [tokens for _, tokens in self.unreported]

    def reported(self) -> None:
        """A report came: prompts sent two reports ago or more are in it (requests and
        reports travel on different sockets, so the one just after a send may miss it)."""
        self.num_reports += 1
        self.unreported = [(n, t) for n, t in self.unreported if n >= self.num_reports - 1]

    def send(self, data: bytes) -> bool:
        """Send without waiting; False if the replica is not connected (or its queue is
        full): the caller treats it as gone."""
        if self.socket is None:
            return False
        try:
            self.socket.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def describe(self) -> dict[str, object]:
        """This replica's row of GET /admin/fleet."""
        stats = self.stats
        kv_usage = None
        if stats is not None and stats.num_kv_blocks_total:
            kv_usage = round(stats.num_kv_blocks_used / stats.num_kv_blocks_total, 4)
        beat = self.beat
        return {
            "id": self.replica_id,
            "node": self.node,
            "pid": self.pid,
            "state": self.shown_state,
            "incarnation": self.incarnation,
            "address": self.address,
            "running": stats.num_running if stats is not None else 0,
            "waiting": stats.num_waiting if stats is not None else 0,
            "kv_usage": kv_usage,
            "step_ms_p50": beat.step_ms_p50 if beat is not None else None,
            "restarts": self.restarts,
            "given_up": self.given_up,
            "requests_from_this_gateway": len(self.requests),
            "routed": self.num_routed,
        }


# SchedulerStats' counts that add up over replicas, and its per-class counts.
_SUMMED = (
    "num_running",
    "num_waiting",
    "num_kv_blocks_used",
    "num_kv_blocks_total",
    "num_prefix_query_tokens",
    "num_prefix_hit_tokens",
    "num_preemptions",
    "num_steps",
)
_SUMMED_BY_CLASS = (
    "num_running_by_class",
    "num_waiting_by_class",
    "num_preemptions_by_class",
    "ttft_sum_s_by_class",
    "ttft_count_by_class",
)


def merge_stats(parts: list[SchedulerStats]) -> SchedulerStats | None:
    """The fleet's stats as one replica's: counts summed; the step-time model's of the
    first replica (one model, one kind of accelerator)."""
    if not parts:
        return None
    merged: dict[str, Any] = {name: sum(getattr(s, name) for s in parts) for name in _SUMMED}
    for name in _SUMMED_BY_CLASS:
        by_class: dict[str, Any] = {}
        for stats in parts:
            for key, value in getattr(stats, name).items():
                by_class[key] = by_class.get(key, 0) + value
        merged[name] = by_class
    return msgspec.structs.replace(parts[0], **merged)
