"""FleetClient: the gateway's ReplicaClient for a fleet of replicas (the single-replica one
is engine/client.py's AsyncEngineClient; the gateway sees only their shared interface).

- **Finding and hearing replicas** (watch.py): new incarnations connected, old ones
  dropped; a replica dead, silent, fenced or slow is the watch's call, what that does to
  the requests on it is this module's.
- **Routing**: interactive requests by the router's score (prefix overlap, salted by key
  group as the engine salts it, and load), kept off a replica predicted to miss the TTFT
  target while another meets it (fleet/ttft.py, from the replicas' own reports); batch
  requests to the ready replica with the fewest of this gateway's batch requests.
- **Admission**: `predict_ttft` is the best replica's prediction; the gateway refuses
  (529 / 429) only when no replica meets the target.
- **Failover**: a replica whose connection closed, or that Ray reports dead or
  restarting, is dead to this gateway: its incarnation is fenced, and each of its requests
  moves to another replica as a new attempt that carries the tokens already received
  (EngineCoreRequest.output_token_ids): the caller's stream goes on without a repeated or
  missing token. The engine request id is `<id>/<attempt>`, so outputs of an older
  attempt (a replica that speaks late) are dropped. A request moved more than `max_moves`
  times, or with no replica to move to for `move_wait_s`, ends with EngineDeadError.
- **Silence**: a silent replica's requests move the same way and it gets no new work
  until it speaks; a fenced one's incarnation is fenced like a dead one's.
- **Slow replicas** (health.py): no new work while another replica is ready.
- **Scaling**: scaling.py's Scaler adds replicas and drains those it removes; a drained
  replica's requests move as a dead one's do, without counting against `max_moves`.

(Over 400 lines: placing and moving requests is one state machine over the same requests
and links: a replica's death moves its requests, a beat unparks them, an output ends them.
Finding and hearing replicas is watch.py, a request's attempts attempts.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenfleet.cluster.attempts import MovingRequest
from tokenfleet.cluster.health import FleetHealth, SlowRule
from tokenfleet.cluster.links import DOWN, ReplicaLink, merge_stats
from tokenfleet.cluster.scaling import Scaler
from tokenfleet.cluster.watch import DEFAULT_FENCE_TIMEOUT_S, Directory, ReplicaWatch
from tokenfleet.cluster.wire import (
    FleetMessage,
    GatewayPing,
    ReplicaBeat,
    ReplicaOutputs,
    ReplicaRejected,
    decode_message,
)
from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tokenfleet.engine.client import Arrival, EngineDeadError, RequestOutputs
from tokenfleet.engine.wire import AbortRequests, AddRequests, EngineReady
from tokenfleet.errors import InvalidRequestError
from tokenfleet.fleet.router import Router, RouterConfig
from tokenfleet.fleet.ttft import ReplicaTTFT
from tokenfleet.policy.admission import Verdict

logger = logging.getLogger(__name__)


class FleetClient:
    def __init__(
        self,
        config: EngineConfig,
        directory: Directory,
        *,
        router_config: RouterConfig | None = None,
        replica_timeout_s: float = 1.5,
        discover_interval_s: float = 0.5,
        max_moves: int = 3,
        move_wait_s: float = 30.0,
        startup_timeout_s: float = 600.0,
        gateway_id: str | None = None,
        host: str = "127.0.0.1",
        ttft_target_s: float = 2.0,
        drain_grace_s: float = 30.0,
        fence_timeout_s: float | None = None,
        slow_rule: SlowRule | None = None,
    ) -> None:
        """`host`: the address replicas reach this gateway at (its node's);
        `fence_timeout_s` None: 10 s, or the replica timeout if longer."""
        if fence_timeout_s is None:
            fence_timeout_s = max(DEFAULT_FENCE_TIMEOUT_S, replica_timeout_s)
        if fence_timeout_s < replica_timeout_s:
            raise ValueError(
                f"the fence timeout ({fence_timeout_s} s) must be at least the replica "
                f"timeout ({replica_timeout_s} s)"
            )
        self.config = config
        self.directory = directory
        self.router = Router(router_config or RouterConfig(), config.cache.block_size)
        self.ttft = ReplicaTTFT.of(config, ttft_target_s)
        self.replica_timeout_s = replica_timeout_s
        self.fence_timeout_s = fence_timeout_s
        self.health = FleetHealth(slow_rule or SlowRule())
        self.discover_interval_s = discover_interval_s
        self.max_moves = max_moves
        self.move_wait_s = move_wait_s
        self.startup_timeout_s = startup_timeout_s
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self._identity = self.gateway_id.encode()
        self.host = host
        self._ctx = zmq.asyncio.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)
        # Plain sockets to send: one per replica, never waited on.
        self._send_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._ctx.underlying)
        self._encoder = msgspec.msgpack.Encoder()
        self.links: dict[int, ReplicaLink] = {}
        self._requests: dict[str, MovingRequest] = {}
        self._queues: dict[str, asyncio.Queue[Arrival | Exception]] = {}  # RequestOutputs'
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = asyncio.Event()
        self._closing = False
        self.num_moves = 0  # requests moved to another replica since start
        self.num_restarts = 0
        self.count_pending: Callable[[], int | None] | None = None
        # AsyncEngineClient's knobs, set by the gateway; the fleet has its own.
        self.restart_backoff_s = self.restart_backoff_max_s = 0.0
        self.scaler = Scaler(self, drain_grace_s)
        self.watch = ReplicaWatch(self)

    # -- the ReplicaClient interface ----------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self.directory.start)
        self.host = getattr(self.directory, "host", self.host)
        self._replies = self._ctx.socket(zmq.PULL)
        port = self._replies.bind_to_random_port(f"tcp://{self.host}")
        self._ping = self._encoder.encode(GatewayPing(f"tcp://{self.host}:{port}"))
        self._tasks = [
            asyncio.create_task(self.watch.discover_loop()),
            asyncio.create_task(self.watch.watchdog(self._ping)),
            asyncio.create_task(self._read()),
        ]
        await self.wait_ready(self.startup_timeout_s)

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def shutdown(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for link in self.links.values():
            link.close()
        self._ctx.destroy(linger=0)
        await asyncio.to_thread(self.directory.shutdown)

    @property
    def pid(self) -> int | None:
        return None  # several processes: GET /admin/fleet lists them

    @property
    def info(self) -> EngineReady | None:
        infos = [link.info for link in self.links.values() if link.info is not None]
        if not infos:
            return None
        # One model everywhere; the tightest cache decides what fits anywhere.
        return min(infos, key=lambda info: info.max_model_len)

    @property
    def stats(self) -> SchedulerStats | None:
        return merge_stats([link.stats for link in self._ready_links() if link.stats])

    def replica_stats(self) -> dict[str, SchedulerStats]:
        """Each replica's latest stats, by replica id (the `replica` label of /metrics)."""
        return {str(i): link.stats for i, link in self.links.items() if link.stats is not None}

    def is_healthy(self) -> bool:
        return any(link.routable for link in self.links.values())

    def predict_ttft(self, num_prompt_tokens: int) -> Verdict | None:
        """The best ready replica's predicted time to first token, as a verdict against
        the target (Retry-After: the excess, whole seconds, at least 1)."""
        best = min(
            (
                self.ttft.predict(link.stats, num_prompt_tokens, link.ahead)
                for link in self._ready_links()
            ),
            default=0.0,
        )
        if self.ttft.meets(best):
            return Verdict(best, "fleet")
        excess = best - self.ttft.ttft_target_s if math.isfinite(best) else 1.0
        return Verdict(best, "fleet", max(1, math.ceil(excess)))

    def describe(self) -> list[dict[str, object]]:
        return [self.links[i].describe() | self.health.describe(i) for i in sorted(self.links)]

    def describe_health(self) -> dict[str, object]:
        """The fleet-wide part of GET /admin/fleet on slow and silent replicas."""
        return self.health.describe_fleet() | {
            "replica_timeout_s": self.replica_timeout_s,
            "fence_timeout_s": self.fence_timeout_s,
        }

    async def submit(
        self, request: EngineCoreRequest, num_pending: int | None = None
    ) -> RequestOutputs:
        if not self.is_healthy():
            raise EngineDeadError("no replica is ready")
        if request.req_id in self._requests:
            raise InvalidRequestError(f"request id {request.req_id!r} is in use")
        queue: asyncio.Queue[Arrival | Exception] = asyncio.Queue()
        moving = MovingRequest(request, queue)
        self._requests[request.req_id] = self._queues_entry(moving)
        if not self._place(moving, num_pending):
            self._forget(moving)
            raise EngineDeadError("no replica could take the request")
        return RequestOutputs(self, request.req_id, queue)  # type: ignore[arg-type]

    def settled(self) -> asyncio.Future[None]:
        # Each request goes out as it is submitted: nothing to wait for.
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        outputs = await self.submit(request)
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield output

    async def abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            moving = self._requests.get(req_id)
            if moving is not None:
                self._abort_on_replica(moving)
                self._forget(moving)

    # -- what the scaler does through the client -----------------------------------

    def scale(self, num_replicas: int) -> dict[str, object]:
        return self.scaler.scale(num_replicas)

    def add_link(self, replica_id: int) -> ReplicaLink:
        link = self.links[replica_id] = ReplicaLink(replica_id)
        self.router.add_replica(replica_id)
        return link

    def drop_link(self, link: ReplicaLink) -> None:
        """The replica is no longer part of this gateway's fleet (drained)."""
        self.move_all(link, f"replica {link.replica_id} leaves the fleet")
        link.close()
        self.links.pop(link.replica_id, None)
        self.router.remove_replica(link.replica_id)

    def move_all(self, link: ReplicaLink, why: str) -> int:
        """Move this gateway's requests off a draining replica; how many."""
        moving = [self._requests[r] for r in list(link.requests) if r in self._requests]
        for one in moving:
            self._move(one, why, drain=True)
        return len(moving)

    def connect(self, link: ReplicaLink) -> None:
        """Connect to a replica's new incarnation and tell it where this gateway is."""
        link.connect(self._send_ctx, self._identity)
        link.send(self._ping)

    def mark_ready(self, link: ReplicaLink) -> None:
        link.state = "ready"
        logger.info("replica %d is ready", link.replica_id)
        self._ready.set()
        self.unpark()

    def unready(self) -> None:
        self._ready.clear()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.create_task(work))

    # -- placing and moving requests ----------------------------------------------

    def _queues_entry(self, moving: MovingRequest) -> MovingRequest:
        self._queues[moving.request.req_id] = moving.queue
        return moving

    def _ready_links(self) -> list[ReplicaLink]:
        """The replicas new work may go to: slow ones only when no other is ready (a slow
        fleet still serves)."""
        ready = [link for link in self.links.values() if link.routable]
        return [link for link in ready if not link.slow] or ready

    def _choose(self, moving: MovingRequest) -> ReplicaLink | None:
        links = self._ready_links()
        if not links:
            return None
        if not moving.interactive:
            return min(links, key=lambda link: (link.num_batch, link.replica_id))
        request = moving.request
        tokens = request.prompt_token_ids + moving.received

        def meets_target(replica_id: int, uncached: int) -> bool:
            link = self.links[replica_id]
            return self.ttft.meets(self.ttft.predict(link.stats, uncached, link.ahead))

        replica_id, uncached = self.router.route(
            tokens,
            [link.replica_id for link in links],
            cache_salt=request.cache_salt,
            meets_target=meets_target,
        )
        moving.routed_tokens = uncached
        link = self.links[replica_id]
        link.unreported.append((link.num_reports, uncached))
        return self.links[replica_id]

    def _place(self, moving: MovingRequest, num_pending: int | None = None) -> bool:
        """Send the request's current attempt to a replica; False if none is ready."""
        link = self._choose(moving)
        if link is None:
            return False
        while link is not None:
            moving.replica_id = link.replica_id
            moving.first_seen = bool(moving.received)
            link.requests.add(moving.request.req_id)
            link.num_routed += 1
            if not moving.interactive:
                link.num_batch += 1
            message = AddRequests([moving.engine_request()], num_pending)
            if link.send(self._encoder.encode(message)):
                return True
            self._leave(moving)
            self.replica_dead(link, "its socket refused a request")
            link = self._choose(moving)
        return False

    def _leave(self, moving: MovingRequest) -> None:
        """The request no longer runs on the replica it was on."""
        link = self.links.get(moving.replica_id)
        if link is not None and moving.request.req_id in link.requests:
            link.requests.discard(moving.request.req_id)
            if not moving.interactive:
                link.num_batch -= 1
            if moving.interactive:
                if not moving.first_seen:
                    self.router.prefilled(link.replica_id, moving.routed_tokens)
                self.router.finished(link.replica_id)
        moving.replica_id = -1

    def _forget(self, moving: MovingRequest) -> None:
        self._leave(moving)
        self._requests.pop(moving.request.req_id, None)
        self._queues.pop(moving.request.req_id, None)

    def _abort_on_replica(self, moving: MovingRequest) -> None:
        link = self.links.get(moving.replica_id)
        if link is not None:
            link.send(self._encoder.encode(AbortRequests([moving.engine_id])))

    def _move(self, moving: MovingRequest, why: str, *, drain: bool = False) -> None:
        self._abort_on_replica(moving)  # in case it only paused: nothing more from it
        self._leave(moving)
        if moving.request.req_id not in self._queues:  # its caller has gone
            self._forget(moving)
            return
        moving.attempt += 1
        moving.num_drain_moves += drain
        if moving.attempt - moving.num_drain_moves > self.max_moves:
            self._fail(moving, f"the request was moved {self.max_moves} times ({why})")
            return
        if not drain:
            self.num_moves += 1
        logger.log(
            logging.INFO if drain else logging.WARNING,
            "request %s moves (attempt %d, %d tokens received): %s",
            moving.request.req_id,
            moving.attempt,
            len(moving.received),
            why,
        )
        if not self._place(moving):
            moving.parked_at = time.monotonic()

    def _fail(self, moving: MovingRequest, message: str) -> None:
        moving.queue.put_nowait(EngineDeadError(message))
        self._forget(moving)

    def unpark(self) -> None:
        now = time.monotonic()
        for moving in list(self._requests.values()):
            if moving.parked_at is None:
                continue
            if moving.request.req_id not in self._queues:  # its caller has gone
                self._forget(moving)
                continue
            if self._place(moving):
                moving.parked_at = None
            elif now - moving.parked_at > self.move_wait_s:
                self._fail(moving, f"no replica to move the request to for {self.move_wait_s} s")

    # -- replicas -------------------------------------------------------------------

    def replica_dead(self, link: ReplicaLink, why: str, state: str = "dead") -> None:
        """Dead (or fenced) to this gateway: its incarnation fenced, its requests moved."""
        if link.incarnation is not None:
            link.fenced.add(link.incarnation)
        was = link.state
        link.state, link.incarnation, link.stats = state, None, None
        link.silent_since, link.slow = None, False
        self.health.forget(link.replica_id)
        link.close()
        if was not in DOWN:
            logger.error("replica %d is %s to this gateway: %s", link.replica_id, state, why)
        if not self.is_healthy():
            self._ready.clear()
        self.move_off(link, why)
        self.scaler.died(link)

    def move_off(self, link: ReplicaLink, why: str) -> None:
        for req_id in list(link.requests):
            moving = self._requests.get(req_id)
            if moving is not None:
                self._move(moving, f"replica {link.replica_id}: {why}")
        link.requests.clear()
        link.num_batch = 0

    async def _read(self) -> None:
        while True:
            data = await self._replies.recv()
            try:
                self._received(decode_message(data))
            except Exception:  # a bug here must not end every stream's reading
                logger.exception("a message from a replica could not be handled")

    def _received(self, message: FleetMessage) -> None:
        link = self.links.get(message.replica_id)
        if link is None or message.incarnation != link.incarnation:
            # Fenced: an incarnation this gateway no longer talks to.
            if link is not None and message.incarnation in link.fenced:
                self.health.num_dropped += 1
            return
        now = time.monotonic()
        self.watch.heard(link, now)
        if isinstance(message, ReplicaBeat):
            link.beat = message
            if message.stats is not None:
                self._reported(link, message.stats)
            self.watch.windowed(link, message.step_ms_window)
            link.info = message.info
            if message.info is not None and link.state == "starting":
                self.mark_ready(link)
        elif isinstance(message, ReplicaOutputs):
            if message.outputs.stats is not None:
                self._reported(link, message.outputs.stats)
            for output in message.outputs.outputs:
                self._output(link, output, now)
        elif isinstance(message, ReplicaRejected):
            moving = self._current(message.rejected.req_id, link)
            if moving is not None:
                error = InvalidRequestError(message.rejected.message, param=message.rejected.param)
                moving.queue.put_nowait(error)
                self._forget(moving)

    def _reported(self, link: ReplicaLink, stats: SchedulerStats) -> None:
        link.stats = stats
        link.reported()
        self.router.report(link.replica_id, stats.num_running + stats.num_waiting)

    def _current(self, engine_id: str, link: ReplicaLink) -> MovingRequest | None:
        """The request of this engine id if that id is its current attempt on `link`."""
        req_id, _, attempt = engine_id.rpartition("/")
        moving = self._requests.get(req_id)
        if moving is None or moving.replica_id != link.replica_id:
            return None
        if str(moving.attempt) != attempt:
            return None
        return moving

    def _output(self, link: ReplicaLink, output: EngineCoreOutput, now: float) -> None:
        moving = self._current(output.req_id, link)
        if moving is None:  # an older attempt, or a request no longer wanted
            if output.req_id.rpartition("/")[0] in self._requests:
                self.health.num_dropped += 1  # it moved: the old attempt speaks late
            return
        if not moving.first_seen and (output.new_token_ids or output.finished):
            moving.first_seen = True
            if moving.interactive:
                self.router.prefilled(link.replica_id, moving.routed_tokens)
        moving.received += output.new_token_ids
        moving.queue.put_nowait((now, output))
        if output.finished:
            self._leave(moving)
            self._requests.pop(moving.request.req_id, None)
