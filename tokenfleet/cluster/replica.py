"""One engine replica for a fleet: the engine's step loop behind a bridge that any number of
gateways reach over tcp://.

    gateway DEALER --> ROUTER [bridge thread] --PUSH ipc--> [engine thread: run_engine]
    gateway PULL  <--- PUSH   [bridge thread] <--PULL ipc--   (one PUSH per gateway)

The engine thread runs engine/process.py's loop unchanged. The bridge thread, which never
waits on a step, remembers which gateway sent each request, sends each gateway the outputs
of its own requests (one message a step), beats every `beat_interval_s` with the engine's
latest stats, and aborts the requests of a gateway silent for `gateway_timeout_s`. Every
message out carries the replica's incarnation.

ReplicaActor wraps a bridge as a Ray actor (placement.py creates them); ReplicaBridge runs
without Ray too (tests of the gateway's client).
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from tokenfleet.cluster.wire import (
    GatewayPing,
    ReplicaBeat,
    ReplicaOutputs,
    ReplicaRejected,
)
from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import EngineCoreOutputs, SchedulerStats
from tokenfleet.engine.process import run_engine
from tokenfleet.engine.wire import (
    AbortRequests,
    EngineMessage,
    EngineReady,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from tokenfleet.runner.fixed_runner import FixedTokenRunner

logger = logging.getLogger(__name__)


class _Id(msgspec.Struct):
    req_id: str


class _AddIds(msgspec.Struct, tag="add"):
    """An AddRequests read for its ids only: the bytes go on to the engine as they came."""

    requests: list[_Id]


_GatewayInput = _AddIds | AbortRequests | GatewayPing | Shutdown

# A beat this late means the bridge thread itself did not run (a frozen process): the
# step intervals across it are not step times (the slow rule's window, health.py).
STALL_S = 1.0


class ReplicaBridge:
    def __init__(
        self,
        config: EngineConfig,
        *,
        replica_id: int = 0,
        host: str = "127.0.0.1",
        incarnation: int | None = None,
        beat_interval_s: float = 0.2,
        gateway_timeout_s: float = 5.0,
    ) -> None:
        self.config = config
        self.replica_id = replica_id
        self.host = host
        # Unique per start of a replica, and larger for a later start on any node whose
        # clock is not behind by more than a restart takes (it is only compared for
        # equality by the gateways: the one they talk to, or not).
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.beat_interval_s = beat_interval_s
        self.gateway_timeout_s = gateway_timeout_s
        self.info: EngineReady | None = None
        self.stats: SchedulerStats | None = None
        self.address = ""
        self._dir = tempfile.mkdtemp(prefix="tokenfleet-replica-")
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._owner: dict[str, bytes] = {}  # request id -> the gateway that sent it
        self._seen: dict[bytes, float] = {}  # gateway -> when it last spoke
        self._replies: dict[bytes, zmq.Socket[bytes]] = {}  # gateway -> a PUSH to it
        self._steps: deque[float] = deque(maxlen=64)  # recent intervals between busy steps
        self._last_step: float | None = None
        self._window: list[float] = []  # busy-step intervals since the last beat
        self._last_beat: float | None = None
        self._stopping = threading.Event()
        self.engine_error: BaseException | None = None
        # Set by the gateway that scales this replica away: gateways read it (describe) and
        # send it no new work. The bridge itself serves on as before.
        self.draining = False

    def start(self) -> None:
        self._gateways = self._ctx.socket(zmq.ROUTER)
        self._gateways.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a gateway that reconnects
        port = self._gateways.bind_to_random_port(f"tcp://{self.host}")
        self.address = f"tcp://{self.host}:{port}"
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._to_engine.bind(f"ipc://{self._dir}/in")
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.bind(f"ipc://{self._dir}/out")
        self._engine = threading.Thread(target=self._run_engine, name="engine", daemon=True)
        self._bridge = threading.Thread(target=self._run_bridge, name="bridge", daemon=True)
        self._engine.start()
        self._bridge.start()

    def stop(self) -> None:
        self._stopping.set()
        self._bridge.join(5)
        self._engine.join(10)

    @property
    def ready(self) -> bool:
        return self.info is not None

    def _run_engine(self) -> None:
        try:
            run_engine(f"ipc://{self._dir}/in", f"ipc://{self._dir}/out", self.config)
        except BaseException as exc:  # the replica is no use without its engine
            self.engine_error = exc
            logger.exception("the engine loop failed")
            if not self._stopping.is_set():
                os._exit(1)  # Ray restarts the actor

    def _run_bridge(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        from_gateway = msgspec.msgpack.Decoder(_GatewayInput)
        from_engine = msgspec.msgpack.Decoder(EngineMessage)
        poller = zmq.Poller()
        poller.register(self._gateways, zmq.POLLIN)
        poller.register(self._from_engine, zmq.POLLIN)
        next_beat = time.monotonic()
        while not self._stopping.is_set():
            timeout_ms = max(0, int((next_beat - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout_ms))
            if self._gateways in events:
                self._from_gateways(from_gateway)
            if self._from_engine in events:
                self._from_the_engine(from_engine, encoder)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.beat_interval_s
                self._beat(encoder, now)
        self._to_engine.send(encoder.encode(Shutdown()))
        self._engine.join(10)
        self._ctx.destroy(linger=0)

    def _from_gateways(self, decoder: msgspec.msgpack.Decoder[Any]) -> None:
        while True:
            try:
                gateway, data = self._gateways.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._seen[gateway] = time.monotonic()
            try:
                message = decoder.decode(data)
            except msgspec.DecodeError:
                logger.error("a message from gateway %r could not be read", gateway)
                continue
            if isinstance(message, GatewayPing):
                if gateway not in self._replies:
                    self._reply_to(gateway, message.reply_to)
            elif isinstance(message, _AddIds):
                for request in message.requests:
                    self._owner[request.req_id] = gateway
                self._to_engine.send(data)
            elif isinstance(message, AbortRequests):
                self._to_engine.send(data)
            # A shutdown is not a gateway's to send: the replica serves others.

    def _reply_to(self, gateway: bytes, address: str) -> None:
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 100_000)
        socket.connect(address)
        self._replies[gateway] = socket

    def _from_the_engine(
        self, decoder: msgspec.msgpack.Decoder[EngineMessage], encoder: msgspec.msgpack.Encoder
    ) -> None:
        while True:
            try:
                data = self._from_engine.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = decoder.decode(data)
            if isinstance(message, EngineReady):
                self.info = message
                logger.info("replica ready: %s", message)
            elif isinstance(message, RequestRejected):
                gateway = self._owner.pop(message.req_id, None)
                if gateway is not None:
                    reply = ReplicaRejected(self.replica_id, self.incarnation, message)
                    self._send(gateway, encoder.encode(reply))
            elif isinstance(message, StepOutputs):
                self._step(message.outputs, encoder)

    def _step(self, step: EngineCoreOutputs, encoder: msgspec.msgpack.Encoder) -> None:
        if step.stats is not None:
            self.stats = step.stats
        now = time.monotonic()
        if step.outputs:
            if self._last_step is not None:
                self._steps.append(now - self._last_step)
                self._window.append(now - self._last_step)
            self._last_step = now
        else:
            self._last_step = None  # idle: the next step's interval is not a step's time
        by_gateway: dict[bytes, list[Any]] = {}
        for output in step.outputs:
            gateway = self._owner.get(output.req_id)
            if gateway is None:
                continue  # its gateway is gone
            if output.finish_reason is not None:
                del self._owner[output.req_id]
            by_gateway.setdefault(gateway, []).append(output)
        for gateway, outputs in by_gateway.items():
            message = ReplicaOutputs(
                self.replica_id,
                self.incarnation,
                EngineCoreOutputs(outputs, step.timestamp, step.stats),
            )
            self._send(gateway, encoder.encode(message))

    def _beat(self, encoder: msgspec.msgpack.Encoder, now: float) -> None:
        gone = [g for g, seen in self._seen.items() if now - seen > self.gateway_timeout_s]
        for gateway in gone:
            del self._seen[gateway]
            reply = self._replies.pop(gateway, None)
            if reply is not None:
                reply.close(linger=0)
            orphans = [r for r, g in self._owner.items() if g == gateway]
            for req_id in orphans:
                del self._owner[req_id]
            if orphans:
                logger.warning(
                    "gateway %r silent for %.1f s: aborting its %d requests",
                    gateway,
                    self.gateway_timeout_s,
                    len(orphans),
                )
                self._to_engine.send(encoder.encode(AbortRequests(orphans)))
        counts: dict[bytes, int] = {}
        for gateway in self._owner.values():
            counts[gateway] = counts.get(gateway, 0) + 1
        if self._last_beat is not None and now - self._last_beat > STALL_S:
            # This thread did not run (the process frozen, SIGSTOP): the interval across
            # the stall is not a step's time, nor is the step in progress.
            logger.warning("the bridge was stalled for %.1f s", now - self._last_beat)
            self._window.clear()
            self._last_step = None
        self._last_beat = now
        step_ms = statistics.median(self._steps) * 1000 if self._steps else None
        window_ms = statistics.fmean(self._window) * 1000 if self._window else None
        self._window = []
        running_s = now - self._last_step if self._last_step is not None and self._owner else 0.0
        for gateway in self._replies:
            beat = ReplicaBeat(
                self.replica_id,
                self.incarnation,
                self.info,
                self.stats,
                step_ms,
                running_s,
                counts.get(gateway, 0),
                window_ms,
            )
            self._send(gateway, encoder.encode(beat))

    def _send(self, gateway: bytes, data: bytes) -> None:
        socket = self._replies.get(gateway)
        if socket is None:
            return  # not pinged yet, or gone
        try:
            socket.send(data, zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: it reads nothing
            logger.debug("a message to gateway %r was dropped", gateway)


class ReplicaActor:
    """A replica as a Ray actor (wrapped with ray.remote by placement.py). Its bridge
    starts at once; `describe` answers while the model loads (ready False)."""

    def __init__(
        self,
        replica_id: int,
        config_json: bytes,
        beat_interval_s: float = 0.2,
        gateway_timeout_s: float = 5.0,
    ) -> None:
        import ray

        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s replica %(levelname)s: %(message)s"
        )
        self.replica_id = replica_id
        config = msgspec.json.decode(config_json, type=EngineConfig)
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.bridge = ReplicaBridge(
            config,
            replica_id=replica_id,
            host=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            beat_interval_s=beat_interval_s,
            gateway_timeout_s=gateway_timeout_s,
        )
        self.bridge.start()

    def describe(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "incarnation": self.bridge.incarnation,
            "address": self.bridge.address,
            "node": self.node_id,
            "pid": os.getpid(),
            "ready": self.bridge.ready,
            "draining": self.bridge.draining,
        }

    def drain(self, draining: bool) -> None:
        self.bridge.draining = draining

    def set_extra_step_s_for_tests(self, seconds: float) -> None:
        """Tests only: every step of this replica's fixed runner takes `seconds` longer
        (a replica made slow on purpose; 0 restores it). The model runner ignores it."""
        FixedTokenRunner.extra_step_s_for_tests = seconds

    def stop(self) -> None:
        self.bridge.stop()
