"""The gateway's connection to one replica: a DEALER socket with the gateway's identity (it
only sends: replies come to the gateway's one PULL socket, wire.py), the replica's latest
beat, and its state as this gateway sees it.

States: "starting" (connected, model loading), "ready" (routable), "dead" (silent past the
timeout, or Ray says so; its incarnation is fenced: nothing more from it is taken, and a
replica comes back only as a new incarnation). The capacity issue adds "draining", "slow"
and "fenced" with behaviour of their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from tokenfleet.cluster.wire import ReplicaBeat
from tokenfleet.core.engine_api import SchedulerStats
from tokenfleet.engine.wire import EngineReady

STATES = ("starting", "ready", "draining", "slow", "fenced", "dead")


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
    # Interactive prompts (uncached tokens) sent since its last report: ahead in its queue.
    unreported: list[int] = field(default_factory=list)

    @property
    def routable(self) -> bool:
        return self.state == "ready" and self.socket is not None

    def connect(self, ctx: zmq.Context[zmq.Socket[bytes]], identity: bytes) -> None:
        self.close()
        socket = ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, identity)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 100_000)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer not connected
        socket.connect(self.address)
        self.socket = socket
        self.last_heard = time.monotonic()

    def close(self) -> None:
        self.unreported.clear()
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None

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
            "state": self.state,
            "incarnation": self.incarnation,
            "address": self.address,
            "running": stats.num_running if stats is not None else 0,
            "waiting": stats.num_waiting if stats is not None else 0,
            "kv_usage": kv_usage,
            "step_ms_p50": beat.step_ms_p50 if beat is not None else None,
            "restarts": self.restarts,
            "requests_from_this_gateway": len(self.requests),
        }
