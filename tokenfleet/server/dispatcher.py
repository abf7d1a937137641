"""The batch dispatcher: leases batch requests from the store, runs them on the engine at
batch priority, and commits each result before it counts.

    store ──lease(n)──► dispatcher task per request ──► engine (priority "batch")
      ▲                         │
      └── complete(epoch) ◄─────┘  result committed, or release() on an engine failure
                                   (queued again; errored after max attempts)

Attempts count only failures of the request itself: an engine that died while the request
ran counts one (so a request that kills its engine every time ends errored, with an error
that says so); a gateway that stops, an engine that was down before the request reached
it, or a lease that expired gives the request back without counting. A store error never
ends the loops here: results wait and their commit is retried with backoff.

It keeps just enough requests in flight to keep the engine's batch queue full (the engine's
sequence slots), so that a cancel or an interactive burst finds little to undo. How many
that is (its capacity) is read again at each lease: a fleet's replicas that take work come
and go as it scales, and the depth follows them. Leases are renewed while their requests
run; a gateway that dies stops renewing, and its leases come back to the queue when they
expire (or at once when it restarts under the same id).

Over 400 lines: leasing, running, group commit, release and shutdown share the in-flight
table and its invariants (one task and one lease epoch per request), so they stay together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from tokenfleet.batch.schema import LeasedRequest, Outcome
from tokenfleet.batch.store import BatchStore
from tokenfleet.engine.client import EngineDeadError
from tokenfleet.fleet.leasing import lease_room
from tokenfleet.server.errors import APIError
from tokenfleet.server.keys import CALLER_GROUP

logger = logging.getLogger(__name__)

T = TypeVar("T")

# endpoint -> runs one request's params to its response body (raises APIError)
Runner = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
# () -> (depth, queue target) now: at most depth batch requests in flight (the sequence
# slots of the replicas taking work), and queue target of them kept waiting in the engines
# beyond those they run
Capacity = Callable[[], tuple[int, int]]
# (api, endpoint, response body) -> the result JSON stored for a success
# (api, endpoint, APIError) -> the result JSON stored for a failure


@dataclass(frozen=True)
class DispatcherConfig:
    owner: str  # this gateway's lease owner id
    lease_s: float = 120.0  # renewed every lease_s / 3 while a request runs
    max_attempts: int = 3  # failures of a request (its engine died running it) before errored
    poll_s: float = 0.05  # how often to look for work when there was none
    maintenance_s: float = 1.0  # expiry, ending batches, dead leases
    archive_s: float = 3600.0  # how often to archive old batches
    retention_s: float = 29 * 24 * 3600.0  # results kept this long after a batch is created
    commit_s: float = 0.02  # results wait at most this long to be committed together
    retry_s: float = 0.05  # first wait after a store error; doubles up to retry_max_s
    retry_max_s: float = 5.0
    stop_commit_s: float = 5.0  # on stop, how long to keep retrying the last results' commit


class BatchDispatcher:
    def __init__(
        self,
        store: BatchStore,
        config: DispatcherConfig,
        runners: dict[str, Runner],
        results: ResultFormats,
        *,
        ready: Callable[[], bool] = lambda: True,
        capacity: Capacity = lambda: (64, 8),
        engine_load: Callable[[], tuple[int, int] | None] = lambda: None,
        counted: Callable[[str, int], None] = lambda outcome, n: None,
        clock: Callable[[], float] = time.time,
        on_finished: Callable[[list[str]], None] = lambda batch_ids: None,
        group_of: Callable[[str], str | None] = lambda owner: None,
    ) -> None:
        self.store = store
        self.config = config
        self.runners = runners
        self.results = results
        self.ready = ready  # lease only while the engine can take work
        self.capacity = capacity  # (depth, queue target), read at each lease
        self.engine_load = engine_load  # (batch running, batch waiting) in the engine, if known
        self.counted = counted  # (outcome, how many): committed results, for /metrics
        self.clock = clock
        # Told the ids of batches that just ended (here or in a cancel route); must not block.
        self.on_finished = on_finished
        # A batch owner's key group: its requests' prefix-cache salt, as its sync requests'.
        self.group_of = group_of
        # One thread: the store's calls from this gateway never contend with each other.
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store")
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._leases: dict[tuple[str, int], int] = {}  # (batch_id, idx) -> epoch
        self._canceling: set[str] = set()  # batches whose running requests are aborted
        self._wake = asyncio.Event()
        # Group commit: results finished within commit_s share one transaction. Each still
        # counts only once committed; a request's slot frees when its commit is done.
        self._outcomes: list[tuple[Outcome, asyncio.Future[bool]]] = []
        self._commit_task: asyncio.Task[None] | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._last_archive = 0.0
        self._last_renew = 0.0
        # A commit took the last results running here of some batch: see at the next tick,
        # not the next maintenance, whether it ended (its caller is waiting for that).
        self._finish_soon = False

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store call on the store's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._db, fn, *args)

    async def start(self) -> None:
        # Whatever this gateway held before a restart died with it: back to the queue now.
        await self.db(self.store.requeue_owner, self.config.owner, self.clock())
        self._loop_task = asyncio.create_task(self._run(), name="batch-dispatcher")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._commit_task is not None:
            self._commit_task.cancel()
            await asyncio.gather(self._commit_task, return_exceptions=True)
        # Results already in hand are kept, the store willing, within stop_commit_s.
        deadline = time.monotonic() + self.config.stop_commit_s
        wait_s = self.config.retry_s
        while self._outcomes and not await self._commit():
            if time.monotonic() + wait_s > deadline:
                break
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, self.config.retry_max_s)
        # What was running goes back to the queue for the next gateway (or this one again),
        # without using up an attempt: the request did nothing wrong.
        with contextlib.suppress(Exception):
            await self.db(self.store.requeue_owner, self.config.owner, self.clock())
        self._db.shutdown(wait=True)

    def wake(self) -> None:
        """New work was accepted: look for it now rather than at the next poll."""
        self._wake.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    async def cancel(self, batch_id: str) -> None:
        """Abort this gateway's running requests of a canceled batch."""
        tasks = [t for (b, _), t in self._tasks.items() if b == batch_id]
        self._canceling.add(batch_id)
        try:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._canceling.discard(batch_id)

    async def _run(self) -> None:
        next_maintenance = 0.0
        failures = 0  # store errors in a row: each doubles the wait before the next try
        while True:
            try:
                now = self.clock()
                # Nothing running here and no open batch anywhere: nothing to maintain or
                # lease. One read then, not a round of store writes (on the store's thread,
                # whose Python takes the GIL from the event loop, in a burst of requests too).
                if not self._tasks and not await self.db(self.store.has_open_batches):
                    self._finish_soon = False  # no open batch: none to end
                    await self._archive(now)
                    next_maintenance = 0.0  # an open batch is maintained at once
                    free = 0
                else:
                    if now >= next_maintenance:
                        self._finish_soon = False
                        await self._maintain(now)
                        next_maintenance = now + self.config.maintenance_s
                    elif self._finish_soon:
                        self._finish_soon = False
                        ended = await self.db(self.store.finish_batches, now)
                        if ended:
                            self.on_finished(ended)
                    # Over the depth after a fleet shrank: nothing leased until enough end.
                    depth, queue_target = self.capacity()
                    free = lease_room(len(self._tasks), self.engine_load(), queue_target, depth)
                leased: list[LeasedRequest] = []
                if free > 0 and self.ready():
                    leased = await self.db(
                        self.store.lease, self.config.owner, free, self.config.lease_s, now, True
                    )
                for request in leased:
                    key = (request.batch_id, request.idx)
                    self._leases[key] = request.epoch
                    self._tasks[key] = asyncio.create_task(self._execute(request))
                failures = 0
                if leased and len(leased) == free:
                    continue  # maybe more: fill up as soon as a slot frees
            except asyncio.CancelledError:
                raise
            except Exception:
                failures += 1
                logger.exception("batch dispatcher step failed (%d in a row); retrying", failures)
                await asyncio.sleep(self._backoff(failures))
            if not self._finish_soon:  # a batch may have ended: look now, not after a wait
                self._wake.clear()
            # With requests running, look again soon: the engine may take more as it runs
            # them (the room follows its running count); idle, once a second.
            wait_s = self.config.poll_s if self._tasks else self.config.poll_s * 20
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns instead of raising
            # when the task is canceled just as the wake comes, and stop() would wait on a
            # loop that never ends.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._wake.wait()

    async def _maintain(self, now: float) -> None:
        store = self.store
        # Judged by the store's clock; the request did nothing wrong: no attempt counted.
        await self.db(store.requeue_expired_leases, now, None, self.config.max_attempts, True)
        expired = await self.db(store.expire_batches, now)
        for batch_id in expired:
            await self.cancel(batch_id)
        if now - self._last_renew >= self.config.lease_s / 3 and self._leases:
            await self.db(store.renew_leases, self.config.owner, self.config.lease_s, now, True)
            self._last_renew = now
        # Requests of batches canceled elsewhere (another gateway) stop here too.
        running = {b for b, _ in self._tasks}
        for batch_id in running:
            batch = await self.db(store.get_batch_any_owner, batch_id)
            if batch is not None and batch.state != "in_progress":
                await self.cancel(batch_id)
        ended = await self.db(store.finish_batches, now)
        if ended:
            self.on_finished(ended)
        await self._archive(now)

    async def _archive(self, now: float) -> None:
        if now - self._last_archive >= min(self.config.archive_s, self.config.retention_s / 4):
            await self.db(self.store.archive_batches, now, self.config.retention_s)
            self._last_archive = now

    async def _execute(self, request: LeasedRequest) -> None:
        key = (request.batch_id, request.idx)
        CALLER_GROUP.set(self.group_of(request.owner))  # this task's own context
        try:
            runner = self.runners[request.endpoint]
            try:
                body = await runner(json.loads(request.params))
            except asyncio.CancelledError:
                # A canceled batch: its running request ends "canceled" (unless expiry got
                # there first: the store refuses a lease that moved on). On shutdown the
                # lease is left for requeue_owner instead.
                if request.batch_id in self._canceling:
                    await asyncio.shield(self._complete(request, "canceled", None))
                raise
            except APIError as exc:
                if exc.status >= 500 and exc.status != 529:
                    await self._release(request, exc)
                    return
                error = self.results.error(request.api, request.endpoint, exc)
                await self._complete(request, "errored", error)
                return
            except Exception as exc:
                logger.exception("batch request %s/%d failed", request.batch_id, request.idx)
                failure = APIError(500, "internal", f"internal error: {type(exc).__name__}")
                await self._complete(
                    request, "errored", self.results.error(request.api, request.endpoint, failure)
                )
                return
            result = self.results.success(request.api, request.endpoint, body)
            await self._complete(request, "succeeded", result)
        except asyncio.CancelledError:
            pass
        finally:
            # Only this task's own entries: if this gateway leased the request again (its
            # lease here had expired), they are the newer task's.
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]
                if self._leases.get(key) == request.epoch:
                    del self._leases[key]
            self._wake.set()

    async def _release(self, request: LeasedRequest, exc: APIError) -> None:
        """Lease a request again after the engine failed it. An engine that died while
        the request ran counts a failed attempt (the request may be what kills it); one
        that was down before the request reached it counts none."""
        error: str | None = None
        if isinstance(exc.__cause__, EngineDeadError) or exc.kind != "engine_down":
            attempts = self.config.max_attempts
            why = APIError(
                exc.status,
                exc.kind,
                f"the engine failed while running this request, on each of its {attempts} "
                f"attempt{'s' if attempts != 1 else ''}; the last time: {exc.message}",
            )
            error = self.results.error(request.api, request.endpoint, why)
        await self._retrying(
            self.store.release,
            request.batch_id,
            request.idx,
            request.epoch,
            self.clock(),
            error,
            self.config.max_attempts,
        )
        self.counted("released", 1)

    def _backoff(self, failures: int) -> float:
        return float(min(self.config.retry_s * 2 ** (failures - 1), self.config.retry_max_s))

    async def _retrying(self, fn: Callable[..., T], *args: Any) -> T:
        """A store call, retried with backoff until it succeeds (or the task is canceled)."""
        failures = 0
        while True:
            try:
                return await self.db(fn, *args)
            except Exception:
                failures += 1
                logger.exception(
                    "batch store call %s failed (%d in a row); retrying",
                    getattr(fn, "__name__", fn),
                    failures,
                )
                await asyncio.sleep(self._backoff(failures))

    async def _complete(self, request: LeasedRequest, status: str, result: str | None) -> None:
        outcome = Outcome(request.batch_id, request.idx, request.epoch, status, result)  # type: ignore[arg-type]
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._outcomes.append((outcome, done))
        if self._commit_task is None or self._commit_task.done():
            self._commit_task = asyncio.create_task(self._commit_soon())
        await done

    async def _commit_soon(self) -> None:
        # Outcomes that arrive while a commit is in flight go in the next round: without the
        # loop, the last of them could wait for a completion that never comes. A failed
        # commit keeps its outcomes for the next round, after a backoff; nothing ends this
        # loop but the last outcome committed (or stop()).
        failures = 0
        while self._outcomes:
            await asyncio.sleep(self.config.commit_s)
            if await self._commit():
                failures = 0
            else:
                failures += 1
                await asyncio.sleep(self._backoff(failures))

    async def _commit(self) -> bool:
        """One try at committing the outcomes waiting; False (and they wait on) on a store
        error."""
        batch, self._outcomes = self._outcomes, []
        if not batch:
            return True
        try:
            outcomes = [o for o, _ in batch]
            accepted = await self.db(self.store.complete_many, outcomes, self.clock())
        except asyncio.CancelledError:
            self._outcomes[:0] = batch  # stop() tries them once more
            raise
        except Exception:
            logger.exception("committing %d batch results failed; retrying", len(batch))
            self._outcomes[:0] = batch  # first in the next round, before later arrivals
            return False
        here = {(o.batch_id, o.idx) for o in outcomes}
        running = {b for b, i in self._tasks if (b, i) not in here}
        if any(o.batch_id not in running for o in outcomes):
            self._finish_soon = True
            self._wake.set()
        if accepted == len(batch):  # the usual case; otherwise the refused are not counted
            for status in {o.status for o, _ in batch}:
                self.counted(status, sum(o.status == status for o, _ in batch))
        if accepted < len(batch):
            logger.info(
                "%d of %d results refused: their leases had moved on (requeued or expired)",
                len(batch) - accepted,
                len(batch),
            )
        for _, done in batch:
            if not done.done():
                done.set_result(True)
        return True


class ResultFormats:
    """How a request's outcome is stored, per API: the lines the results files are made of
    (Anthropic: the `result` of a results line; OpenAI: the `response` / `error` of an
    output or error file line)."""

    def success(self, api: str, endpoint: str, body: dict[str, Any]) -> str:
        if api == "anthropic":
            return json.dumps({"type": "succeeded", "message": body})
        return json.dumps({"status_code": 200, "body": body})

    def error(self, api: str, endpoint: str, error: APIError) -> str:
        from tokenfleet.server.errors import anthropic_error_body, openai_error_body

        if api == "anthropic":
            return json.dumps(
                {"type": "errored", "error": anthropic_error_body(error.kind, error.message)}
            )
        body = openai_error_body(error.kind, error.message, error.param)
        return json.dumps({"status_code": error.status, "body": body})
