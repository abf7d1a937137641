"""Each key group's interactive limits held once for every gateway sharing the batch store:
the buckets and running counts live in the store (batch/limits_store.py), so that N
gateways allow a group its concurrency, requests and tokens a minute once, not N times.

Same interface and accounting as limits.RateLimiter. The store's side:

    enter          one short transaction: take a request, count the group's running
                   requests on every gateway's live slots, count this one on this gateway's
    charge_tokens  one UPDATE ... RETURNING
    leave          one UPDATE; the gateway's `release` does not wait for it
    headers        no store call: the buckets as this gateway's last check of the group
                   read them, refilled to the reply's time

The gateway's calls (`admit`, `charge`, `release`) run in a small thread pool of their own
(one thread on SQLite, whose writes go one at a time), off the event loop, as the batch
dispatcher's store calls run on its thread.

Clock: buckets refill and slot leases run out by the store's clock, as batch leases do, so
that gateways whose clocks disagree agree on both (a test may give its own clock instead).

Leases: a gateway's running counts (its slots) count only until their lease runs out; it
renews them every lease_s / 3 while it runs, and clears them when it starts and stops. The
slots of a gateway that died come back to their groups lease_s after its last renewal.

A store outage never refuses every request: a check the store does not answer (an error,
or no answer within check_timeout_s) is made by this gateway's own RateLimiter for that
request, and for retry_s after a failure the checks go there without trying the store.
The first failure is logged, once until the store answers again. Meanwhile each gateway
holds the limits on its own (N gateways: N times them), and the leaves the store missed
are counted down at the next renewal that reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from tokenfleet.batch.database import StoreBase
from tokenfleet.batch.limits_store import Level, LimitsStore, Take
from tokenfleet.server.limits import (
    Bucket,
    GroupLimits,
    RateLimiter,
    over_concurrency,
    over_requests,
    over_tokens,
    rate_limit_headers,
)

T = TypeVar("T")

logger = logging.getLogger(__name__)

SLOT_LEASE_S = 30.0  # a dead gateway's running requests stop counting this long after
CHECK_TIMEOUT_S = 2.0  # a check the store has not answered by then is made locally
RETRY_S = 5.0  # after a store failure, checks are local this long before trying it again
NUM_THREADS = 4  # PostgreSQL's; SQLite's writes go one at a time, and so does its pool


class _Unanswered(Exception):
    """The store failed a call, or failed one less than retry_s ago."""


class SharedRateLimiter:
    """The limits of every group, in the batch store, for gateway `gateway` (its batch
    lease owner id: distinct for each gateway sharing the store). `clock`: None for the
    store's clock (and time.monotonic here); a test's clock is used for both."""

    def __init__(
        self,
        limits: GroupLimits,
        store: StoreBase,
        gateway: str,
        *,
        clock: Callable[[], float] | None = None,
        lease_s: float = SLOT_LEASE_S,
        check_timeout_s: float = CHECK_TIMEOUT_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self.limits = limits
        self.store = LimitsStore(store)
        self.gateway = gateway
        self.store_clock = clock is None
        self.clock = clock or time.monotonic
        self.lease_s = lease_s
        self.check_timeout_s = check_timeout_s
        self.retry_s = retry_s
        self.local = RateLimiter(limits, self.clock)  # during an outage
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        # An enter takes a request (or, without a requests limit, only locks the group's
        # row), a charge takes tokens; each reads the other bucket too, for the headers.
        self._enter_takes = [Take("requests", 1 if rpm else 0, rpm)]
        self._enter_takes += [Take("tokens", 0, tpm)] if tpm else []
        self._requests_read = [Take("requests", 0, rpm)] if rpm else []
        self._lock = threading.Lock()  # what follows, shared by the pool's threads
        self._num_held: Counter[str] = Counter()  # this gateway's requests the store counts
        self._num_owed: Counter[str] = Counter()  # of those, ended but not yet counted down
        self._read: dict[tuple[str, str], Bucket] = {}  # the buckets as last read, refilling
        self._local_groups: set[str] = set()  # groups whose last check was made locally
        self._down_until: float | None = None  # None: the store answered the last call
        # (Two SQLite writers of one process wait for each other in the busy handler's
        # sleeps, milliseconds each, where one thread would have queued them.)
        num_threads = 1 if store.is_sqlite else NUM_THREADS
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="shared-limits")
        self._renewal: asyncio.Task[None] | None = None

    # -- the gateway's calls (Limiter), on its event loop -----------------------------------

    async def start(self) -> None:
        """Whatever this gateway counted before a restart ended with it; then renew."""
        with contextlib.suppress(_Unanswered):
            await self._in_pool(self._from_store, lambda now: self.store.clear(self.gateway), True)
        self._renewal = asyncio.create_task(self._renew_forever(), name="shared-limits")

    async def close(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
            await asyncio.gather(self._renewal, return_exceptions=True)
        await asyncio.to_thread(self._pool.shutdown, True)  # the leaves under way land
        with contextlib.suppress(DBAPIError, PoolTimeout):
            await asyncio.to_thread(self.store.clear, self.gateway)

    async def admit(self, group: str) -> None:
        if not (self.limits.max_concurrent or self.limits.requests_per_minute):
            return
        if self._store_down():  # not even queued behind the calls the store holds up
            return self._enter_locally(group)
        entering = self._pool.submit(self.enter, group)
        try:
            await asyncio.wait_for(asyncio.wrap_future(entering), self.check_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            # The store may still count it: then it is counted down once it has.
            entering.add_done_callback(lambda done: self._undo_enter(group, done))
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._store_failed(f"no answer within {self.check_timeout_s} s", self.clock())
            self._enter_locally(group)

    def release(self, group: str) -> None:
        with contextlib.suppress(RuntimeError):  # closed: its slots are cleared
            self._pool.submit(self.leave, group)

    async def charge(self, group: str, tokens: int) -> None:
        if not self.limits.tokens_per_minute:
            return
        if self._store_down():
            return self._charge_locally(group, tokens)
        charging = self._pool.submit(self.charge_tokens, group, tokens)
        try:
            await asyncio.wait_for(asyncio.wrap_future(charging), self.check_timeout_s)
        except TimeoutError:
            self._store_failed(f"no answer within {self.check_timeout_s} s", self.clock())
            self._charge_locally(group, tokens)

    def headers(self, group: str, anthropic: bool) -> list[tuple[bytes, bytes]]:
        with self._lock:
            if group in self._local_groups:
                return self.local.headers(group, anthropic)
            now, limits = self.clock(), self.limits
            buckets = []
            for kind, limit in (
                ("requests", limits.requests_per_minute),
                ("tokens", limits.tokens_per_minute),
            ):
                bucket = self._read.get((group, kind)) or Bucket(limit, now)
                buckets.append((kind, bucket, limit))
            return rate_limit_headers(buckets, now, anthropic)

    # -- RateLimiter's interface: each call waits for the store ------------------------------

    def enter(self, group: str) -> None:
        """An interactive API request starts: RateLimited over the group's concurrency or
        requests per minute (on every gateway); else the caller must call `leave`."""
        limits = self.limits
        if not (limits.max_concurrent or limits.requests_per_minute):
            return
        try:
            if limits.max_concurrent:
                entered = self._from_store(
                    lambda now: self.store.enter(
                        group,
                        self.gateway,
                        self._enter_takes,
                        limits.max_concurrent,
                        self.lease_s,
                        now,
                        self.store_clock,
                    )
                )
                levels, num_running = entered.levels, entered.num_running
                admitted = entered.admitted
            else:
                levels = self._from_store(
                    lambda now: self.store.take(group, self._enter_takes, now, self.store_clock)
                )
                num_running, admitted = 0, levels["requests"].granted
        except _Unanswered:
            return self._enter_locally(group)
        self._saw(group, levels)
        if admitted:
            if limits.max_concurrent:
                with self._lock:
                    self._num_held[group] += 1
            return
        if limits.max_concurrent and num_running >= limits.max_concurrent:
            raise over_concurrency(num_running, limits.max_concurrent)
        rpm = limits.requests_per_minute
        raise over_requests(rpm, (1 - levels["requests"].level) / (rpm / 60))

    def leave(self, group: str) -> None:
        # Running requests are alike: one counted in the store, else one counted locally.
        with self._lock:
            if not self._num_held[group]:
                if self.local.num_running(group):
                    self.local.leave(group)
                return
            self._num_held[group] -= 1
        try:
            self._from_store(lambda now: self.store.leave(group, self.gateway))
        except _Unanswered:
            with self._lock:
                self._num_owed[group] += 1

    def charge_tokens(self, group: str, tokens: int) -> None:
        """An engine request of `tokens` (prompt + max_tokens): RateLimited if the group's
        tokens per minute (on every gateway) cannot cover it now."""
        limit = self.limits.tokens_per_minute
        if not limit:
            return
        if tokens > limit:
            raise over_tokens(tokens, limit, math.inf)
        take = [Take("tokens", tokens, limit), *self._requests_read]
        try:
            levels = self._from_store(
                lambda now: self.store.take(group, take, now, self.store_clock)
            )
        except _Unanswered:
            return self._charge_locally(group, tokens)
        self._saw(group, levels)
        if not levels["tokens"].granted:
            raise over_tokens(tokens, limit, (tokens - levels["tokens"].level) / (limit / 60))

    def renew(self) -> None:
        """Renew this gateway's slot leases, counting down the leaves the store missed."""
        with self._lock:
            owed = dict(self._num_owed)
            self._num_owed.clear()
        try:
            self._from_store(
                lambda now: self.store.renew(
                    self.gateway, self.lease_s, now, self.store_clock, owed
                ),
                probe=True,
            )
        except _Unanswered:
            with self._lock:
                self._num_owed.update(owed)

    # -- the store, and the local limiter when it does not answer ----------------------------

    def _from_store(self, call: Callable[[float], T], probe: bool = False) -> T:
        """`call(now)`; _Unanswered if the store failed it, or failed a call less than
        retry_s ago (unless `probe`: try it anyway)."""
        now = self.clock()
        if not probe and self._store_down():
            raise _Unanswered
        try:
            result = call(now)
        except (DBAPIError, PoolTimeout) as exc:  # the database's errors, not the code's
            self._store_failed(str(exc).splitlines()[0], now)
            raise _Unanswered from exc
        with self._lock:
            if self._down_until is not None:
                self._down_until = None
                logger.info("shared limits: the batch store answers again")
        return result

    def _store_down(self) -> bool:
        """Whether the store failed a call less than retry_s ago."""
        with self._lock:
            return self._down_until is not None and self.clock() < self._down_until

    def _store_failed(self, why: str, now: float) -> None:
        with self._lock:
            if self._down_until is None:
                logger.warning(
                    "shared limits: the batch store did not answer (%s); each gateway holds "
                    "the limits on its own until it does",
                    why,
                )
            self._down_until = now + self.retry_s

    def _enter_locally(self, group: str) -> None:
        with self._lock:
            self._local_groups.add(group)
            self.local.enter(group)

    def _charge_locally(self, group: str, tokens: int) -> None:
        with self._lock:
            self._local_groups.add(group)
            self.local.charge_tokens(group, tokens)

    def _saw(self, group: str, levels: dict[str, Level]) -> None:
        """Keep the buckets as the store returned them, for the headers."""
        now, limits = self.clock(), self.limits
        per_minute = {"requests": limits.requests_per_minute, "tokens": limits.tokens_per_minute}
        with self._lock:
            self._local_groups.discard(group)
            for kind, read in levels.items():
                self._read[group, kind] = Bucket(per_minute[kind], now, read.level)

    def _undo_enter(self, group: str, done: Future[None]) -> None:
        if not done.cancelled() and done.exception() is None:
            self.release(group)

    async def _in_pool(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self._in_pool(self.renew)
            except Exception:  # renewals must go on: without them the slots run out
                logger.exception("shared limits: renewing this gateway's slots failed")
