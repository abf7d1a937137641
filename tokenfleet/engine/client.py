"""The gateway's handle on one local engine replica (the ReplicaClient of DESIGN.md).

Starts the engine process, sends it requests and aborts over ZMQ, and routes each step's
outputs to the asyncio queue of the request they belong to. A watchdog notices a dead or
silent engine, fails every request in flight with EngineDeadError and starts a new one.
(Over 400 lines: the process's whole lifecycle, start, watch, back off and restart, stays
in one place with the queues it fails.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tokenfleet.engine.wire import (
    AbortRequests,
    AddRequests,
    EngineMessage,
    EngineReady,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from tokenfleet.errors import InvalidRequestError, TokenfleetError

logger = logging.getLogger(__name__)


# An output and when its step's message reached this process (time.monotonic()).
Arrival = tuple[float, EngineCoreOutput]


# Submits this far apart end a burst (engine_proc's own arrival window waits 1 ms for a lone
# request, 5 ms within a burst).
QUIET_S = 0.002


class EngineDeadError(TokenfleetError):
    """The engine process died or went silent; requests in flight are lost (HTTP 503)."""


class RequestFailedError(TokenfleetError):
    """The engine ended this request with an error of its own (finish_reason "error": its
    sampling, its output's encoding, ...); the engine and its other requests go on."""

    def __init__(self, req_id: str, message: str) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.message = message


class AsyncEngineClient:
    def __init__(
        self,
        config: EngineConfig,
        *,
        heartbeat_timeout_s: float = 30.0,
        startup_timeout_s: float = 600.0,
        restart_backoff_s: float = 0.5,
        restart_backoff_max_s: float = 60.0,
    ) -> None:
        self.config = config
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # An engine that has not sent EngineReady this long after it was started is killed
        # (and, after the first start, started again).
        self.startup_timeout_s = startup_timeout_s
        # Restarts back off: the n-th in a row waits restart_backoff_s * 2**(n-1), at most
        # restart_backoff_max_s; an engine that stays ready that long ends the row.
        self.restart_backoff_s = restart_backoff_s
        self.restart_backoff_max_s = restart_backoff_max_s
        self._restarts_in_a_row = 0
        self._spawned_at = 0.0
        self._ready_at: float | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="tokenfleet-"))
        self._ctx = zmq.asyncio.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._queues: dict[str, asyncio.Queue[Arrival | Exception]] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._input: zmq.Socket[bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = asyncio.Event()
        self._generation = 0
        self.info: EngineReady | None = None
        self.stats: SchedulerStats | None = None
        self.last_heartbeat = 0.0
        self.num_restarts = 0
        self.num_moves = 0  # one engine: a request whose engine dies is lost, never moved
        self._closing = False
        # settled(): done at the engine's next output, or once submits pause.
        self._settle_waiters: list[asyncio.Future[None]] = []
        self._quiet_timer: asyncio.TimerHandle | None = None
        self._last_submit = 0.0
        # The first request submitted in a turn of the event loop goes at once; the turn's
        # later ones wait here and go together once the loop has polled its sockets again
        # (_end_turn).
        self._turn_open = False
        self._adds: list[EngineCoreRequest] = []
        self._adds_num_pending: int | None = None
        self._told_num_pending: int | None = None  # the count the last message carried
        # Set by the gateway: how many requests it has taken in and not submitted, counted
        # now (None: it cannot tell). Without it, a submit's own count goes with it.
        self.count_pending: Callable[[], int | None] | None = None

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        # A plain (not asyncio) socket: a send never waits (below), and the asyncio one
        # wraps each send in a future, on the path of every request to the engine.
        self._input = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block a sender while the engine is up
        self._input.bind(f"ipc://{self._dir}/in")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(f"ipc://{self._dir}/out")
        self._spawn()
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watchdog()),
        ]
        await self.wait_ready(self.startup_timeout_s)

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def shutdown(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._proc and self._proc.poll() is None:
            with contextlib.suppress(EngineDeadError):
                await self._send(Shutdown())
            try:
                await asyncio.wait_for(asyncio.to_thread(self._proc.wait), 10)
            except TimeoutError:
                self._proc.kill()
        if self._input is not None:
            self._input.close(linger=0)  # not the asyncio context's: it would wait for it
        self._ctx.destroy(linger=0)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_healthy(self) -> bool:
        return (
            self._ready.is_set()
            and self._proc is not None
            and self._proc.poll() is None
            and time.monotonic() - self.last_heartbeat < self.heartbeat_timeout_s
        )

    def describe(self) -> list[dict[str, object]]:
        """The one replica's row of GET /admin/fleet (the fleet's fields; a local engine
        process has no node but this one, and its incarnation is its start's number)."""
        stats = self.stats
        kv_usage = None
        if stats is not None and stats.num_kv_blocks_total:
            kv_usage = round(stats.num_kv_blocks_used / stats.num_kv_blocks_total, 4)
        alive = self._proc is not None and self._proc.poll() is None
        state = "ready" if self.is_healthy() else ("starting" if alive else "dead")
        return [
            {
                "id": 0,
                "node": "local",
                "pid": self.pid,
                "state": state,
                "incarnation": self._generation,
                "running": stats.num_running if stats is not None else 0,
                "waiting": stats.num_waiting if stats is not None else 0,
                "kv_usage": kv_usage,
                "step_ms_p50": None,
                "restarts": self.num_restarts,
            }
        ]

    def replica_stats(self) -> dict[str, SchedulerStats]:
        return {"0": self.stats} if self.stats is not None else {}

    def predict_ttft(self, num_prompt_tokens: int) -> None:
        """None: one engine, whose in-flight requests the gateway's own admission control
        follows itself (GenerationService.admit)."""
        return None

    def _spawn(self) -> None:
        self._ready.clear()
        self._ready_at = None
        self._spawned_at = time.monotonic()
        self._generation += 1
        config_json = msgspec.json.encode(self.config).decode()
        argv = [sys.executable, "-m", "tokenfleet.engine.process"]
        argv += [f"ipc://{self._dir}/in", f"ipc://{self._dir}/out", config_json]
        self._proc = subprocess.Popen(argv, env=os.environ.copy())
        logger.info("engine process %d started", self._proc.pid)

    def restart_delay(self) -> float:
        """How long to wait before the next restart: the backoff of the restarts in a row
        (none for the first after an engine that stayed up)."""
        ready_at = self._ready_at
        if ready_at is not None and time.monotonic() - ready_at >= self.restart_backoff_max_s:
            self._restarts_in_a_row = 0
        n = self._restarts_in_a_row
        if n == 0:
            return 0.0
        return min(self.restart_backoff_max_s, self.restart_backoff_s * 2.0 ** (n - 1))

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            assert self._proc is not None
            now = time.monotonic()
            dead = self._proc.poll() is not None
            silent = self._ready.is_set() and now - self.last_heartbeat > self.heartbeat_timeout_s
            hung_start = not self._ready.is_set() and now - self._spawned_at > (
                self.startup_timeout_s
            )
            if (dead or silent or hung_start) and not self._closing:
                if dead:
                    why = f"exited with {self._proc.returncode}"
                elif silent:
                    why = "stopped answering"
                else:
                    why = f"sent no EngineReady within {self.startup_timeout_s:g} s of its start"
                delay = self.restart_delay()
                logger.error(
                    "engine process %d %s: restarting in %.1f s", self._proc.pid, why, delay
                )
                if not dead:
                    self._proc.kill()
                    await asyncio.to_thread(self._proc.wait)
                self._fail_all(EngineDeadError("the engine process died; the request was lost"))
                self.num_restarts += 1
                self._restarts_in_a_row += 1
                if delay > 0:
                    await asyncio.sleep(delay)
                if self._closing:
                    return
                self._spawn()

    def _fail_all(self, error: Exception) -> None:
        self._settle()
        self._adds = []  # failed below: never to be sent to the next engine
        self._ready.clear()
        self.stats = None  # the dead engine's gauges are no longer true
        for queue in self._queues.values():
            queue.put_nowait(error)

    async def _receive_loop(self) -> None:
        while True:
            message = self._decoder.decode(await self._output.recv())
            self.last_heartbeat = now = time.monotonic()
            if isinstance(message, StepOutputs):
                self._settle()
                self.stats = message.outputs.stats
                for output in message.outputs.outputs:
                    queue = self._queues.get(output.req_id)
                    if queue is not None:
                        queue.put_nowait((now, output))
            elif isinstance(message, EngineReady):
                self.info = message
                self._ready_at = now
                self._ready.set()
                logger.info("engine ready: %s", message)
            elif isinstance(message, RequestRejected):
                queue = self._queues.get(message.req_id)
                if queue is not None:
                    queue.put_nowait(InvalidRequestError(message.message, param=message.param))

    # -- requests -----------------------------------------------------------------

    async def submit(
        self, request: EngineCoreRequest, num_pending: int | None = None
    ) -> RequestOutputs:
        """Send the request to the engine (now, or at the end of this turn of the event loop
        with the others submitted after the turn's first); its outputs come from the
        returned iterator.
        The caller starts its reply meanwhile (a streamed response's headers during the
        prefill), and closes the iterator when done: early, that aborts the request.
        `num_pending`: how many more requests the caller has taken in and will submit
        soon (None: unknown); an idle engine waits for them before its first step."""
        if not self.is_healthy():
            raise EngineDeadError("the engine is not running")
        if request.req_id in self._queues:
            raise InvalidRequestError(f"request id {request.req_id!r} is in use")
        queue: asyncio.Queue[Arrival | Exception] = asyncio.Queue()
        self._queues[request.req_id] = queue
        if self._turn_open:
            self._adds.append(request)
            self._adds_num_pending = num_pending
        else:
            # The engine starts its arrival window on this one, told how many are coming.
            try:
                failed = self._send_now(AddRequests([request], num_pending))
            except BaseException:
                del self._queues[request.req_id]
                raise
            if failed:
                del self._queues[request.req_id]
                raise failed[request.req_id]
            self._turn_open = True
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self._end_turn)
        self._last_submit = time.monotonic()
        if self._quiet_timer is None:
            self._quiet_timer = asyncio.get_running_loop().call_later(QUIET_S, self._check_quiet)
        return RequestOutputs(self, request.req_id, queue)

    def settled(self) -> asyncio.Future[None]:
        """A future done when the engine sends its next output, or once no request has
        been submitted for QUIET_S: a burst of requests is in the engine. Streams set up
        their replies then, so that this work does not hold back the burst's later
        requests on their way to the engine (the first token takes a step anyway)."""
        waiter = asyncio.get_running_loop().create_future()  # its own: a waiter may cancel
        self._settle_waiters.append(waiter)
        return waiter

    def _check_quiet(self) -> None:
        left = self._last_submit + QUIET_S - time.monotonic()
        if left > 0:
            self._quiet_timer = asyncio.get_running_loop().call_later(left, self._check_quiet)
            return
        self._quiet_timer = None
        self._settle()

    def _settle(self) -> None:
        waiters, self._settle_waiters = self._settle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        """Yield the request's outputs step by step; closing the iterator early aborts it."""
        outputs = await self.submit(request)
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield output

    async def abort(self, req_ids: list[str]) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead engine has freed everything
            await self._send(AbortRequests(req_ids))

    def _end_turn(self) -> None:
        """Two turns of the event loop after a turn's first request, so once its loop has
        polled the sockets again and handled what they held (asyncio handles a poll's events
        in the turn after it, uvloop within it): send the requests submitted since, with the
        gateway's count of those it has taken in since then (`counted_after_poll`: an idle
        engine told 0 after a burst starts at once). With no request to send, the count goes
        alone when the engine was last told that some were coming (they failed their checks,
        or went with this turn's first request): it would wait for them otherwise."""
        if not self._turn_open:
            return  # an abort sent them already
        count = self.count_pending
        self._flush_adds(count() if count is not None else None)

    def _flush_adds(self, count_after_poll: int | None = None) -> None:
        """Send what was submitted after the turn's first request, as one message: the rest
        of a burst (each HTTP request's task submits in turn) reaches the engine together,
        one wake-up of each side for all of it. With `count_after_poll` (_end_turn), that
        count; else (unchecked) the latest submit's."""
        self._turn_open = False
        requests, self._adds = self._adds, []
        counted_after_poll = count_after_poll is not None
        if not requests and not (counted_after_poll and self._told_num_pending):
            return
        num_pending = count_after_poll if counted_after_poll else self._adds_num_pending
        # Whatever goes wrong here fails these requests (this runs from the event loop's
        # callbacks too, where an exception would be logged and the requests forgotten).
        failed: dict[str, Exception]
        try:
            failed = dict(self._send_now(AddRequests(requests, num_pending, counted_after_poll)))
        except Exception as exc:
            if not isinstance(exc, EngineDeadError):
                logger.exception("requests could not be sent to the engine")
            failed = {request.req_id: exc for request in requests}
        for req_id, error in failed.items():
            queue = self._queues.get(req_id)
            if queue is not None:
                queue.put_nowait(error)

    async def _send(self, message: AbortRequests | Shutdown) -> None:
        self._flush_adds()  # an abort of a request submitted in this turn comes after it
        self._send_now(message)

    def _send_now(
        self, message: AddRequests | AbortRequests | Shutdown
    ) -> dict[str, InvalidRequestError]:
        """Send now; returns the requests of an AddRequests that could not be encoded
        (a value past what the wire holds, such as an integer over 64 bits), each with its
        error: the message goes without them."""
        # Never wait: a PUSH socket with no engine connected (dead, or exiting) would block
        # the sender forever. The queue itself is unbounded (SNDHWM 0).
        assert self._input is not None, "send before start"
        failed: dict[str, InvalidRequestError] = {}
        try:
            data = self._encoder.encode(message)
        except (TypeError, ValueError, OverflowError):
            if not isinstance(message, AddRequests):
                raise
            message, failed = self._without_unencodable(message)
            data = self._encoder.encode(message)
        try:
            self._input.send(data, zmq.NOBLOCK)
        except zmq.Again as exc:
            raise EngineDeadError("the engine process is not connected") from exc
        if isinstance(message, AddRequests):
            self._told_num_pending = message.num_pending
        return failed

    def _without_unencodable(
        self, message: AddRequests
    ) -> tuple[AddRequests, dict[str, InvalidRequestError]]:
        kept, failed = [], {}
        for request in message.requests:
            try:
                self._encoder.encode(request)
            except (TypeError, ValueError, OverflowError) as exc:
                failed[request.req_id] = InvalidRequestError(
                    f"the request cannot be sent to the engine: {exc}"
                )
            else:
                kept.append(request)
        return AddRequests(kept, message.num_pending, message.counted_after_poll), failed


class RequestOutputs:
    """One submitted request's outputs, step by step, until the finished one. `aclose()`
    forgets the request and, unless it finished, aborts it in the engine (also when no
    output was read yet, which an unstarted async generator's close would not do).
    `arrived`: when the last output returned reached this process (time.monotonic()),
    before any wait for this request's turn on the event loop."""

    def __init__(
        self,
        client: AsyncEngineClient,
        req_id: str,
        queue: asyncio.Queue[Arrival | Exception],
    ) -> None:
        self._client, self.req_id, self._queue = client, req_id, queue
        self.finished = self.closed = False
        self.arrived = 0.0

    def __aiter__(self) -> RequestOutputs:
        return self

    async def __anext__(self) -> EngineCoreOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.arrived, output = item
        self.finished = output.finished
        if output.finish_reason == "error":
            raise RequestFailedError(self.req_id, output.error or "the request failed")
        return output

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._client._queues.pop(self.req_id, None)
        if not self.finished and self._client.is_healthy():
            # Cancelled mid-stream (a client disconnect): free its blocks now.
            await self._client.abort([self.req_id])
