"""Key groups' interactive limits held once for every gateway sharing the batch store
(SharedRateLimiter), on a real SQLite file and a real PostgreSQL: two limiters on one
store ("two gateways") limit a group as one gateway's RateLimiter does, with the same
refusals and headers; a dead gateway's running requests stop counting after its lease;
a store that cannot be reached, or does not answer in time, leaves each gateway its own
limits for that request, logged once. And end to end: two `tokenfleet serve` on one
PostgreSQL allow a group its requests a minute once in all."""

from __future__ import annotations

import asyncio
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from sqlalchemy import create_engine, func, make_url, select, text
from support.live_server import MODEL, free_port, live_server, wait_until
from support.postgres import store_url

from tokenfleet.batch.limits_store import LimitsStore
from tokenfleet.batch.schema import rate_slots
from tokenfleet.batch.store import BatchStore, engine_url
from tokenfleet.cli.main import build_parser
from tokenfleet.server.limits import GroupLimits, RateLimited, RateLimiter
from tokenfleet.server.settings import BatchConfig, ServeConfig
from tokenfleet.server.shared_limits import SharedRateLimiter

LOGGER = "tokenfleet.server.shared_limits"
USER: list[Any] = [{"role": "user", "content": "Say hello."}]


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return store_url(request, tmp_path)


@pytest.fixture
def stores(url: str) -> Iterator[tuple[BatchStore, BatchStore]]:
    """Two gateways' stores (engines and pools of their own) on one database."""
    with BatchStore(url) as a, BatchStore(url) as b:
        yield a, b


def outcome(call: Callable[..., None], *args: Any) -> tuple[int, str, str] | None:
    """None, or a refusal's (retry-after, which, message)."""
    try:
        call(*args)
    except RateLimited as exc:
        return exc.retry_after_s, exc.which, exc.message
    return None


def headers(limiter: RateLimiter | SharedRateLimiter, group: str) -> dict[bytes, bytes]:
    """A reply's rate-limit headers in both APIs' names, but Anthropic's resets (a wall-clock
    time, to the second: two calls may straddle one)."""
    both = limiter.headers(group, anthropic=False) + limiter.headers(group, anthropic=True)
    return {k: v for k, v in both if not (k.startswith(b"anthropic") and k.endswith(b"reset"))}


def slots(store: BatchStore, gateway: str) -> int:
    with store.engine.connect() as conn:
        query = select(func.count()).where(rate_slots.c.gateway == gateway)
        return int(conn.execute(query).scalar_one())


# Each step: (seconds on the clock, gateway, call, group, tokens); a leave ends one of the
# group's requests on that gateway.
STEPS = [
    (0.0, "a", "enter", "g", 0),
    (0.0, "b", "enter", "g", 0),
    (0.0, "a", "enter", "g", 0),  # 2 running, one on each: over the concurrency
    (0.0, "b", "enter", "h", 0),  # another group's allowance is its own
    (0.0, "b", "leave", "g", 0),
    (0.0, "a", "enter", "g", 0),  # the third request of a minute of 3
    (0.0, "a", "leave", "g", 0),
    (0.0, "b", "enter", "g", 0),  # over the requests per minute: one every 20 s
    (18.5, "a", "enter", "g", 0),  # 0.925 of a request refilled: 1.5 s to go
    (20.0, "b", "enter", "g", 0),
    (20.0, "a", "charge", "g", 590),
    (20.0, "b", "charge", "g", 20),  # 10 tokens short at 10 a second
    (20.0, "a", "charge", "g", 601),  # more than a minute's allowance: never
    (21.5, "b", "charge", "g", 25),
    (21.5, "a", "charge", "g", 1),
]


def test_two_gateways_on_one_store_limit_a_group_as_one_gateway_does(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    clock = Clock(0.0)
    limits = GroupLimits(max_concurrent=2, requests_per_minute=3, tokens_per_minute=600)
    one = RateLimiter(limits, clock)  # what one gateway does: the expected outcomes
    gateways = {
        name: SharedRateLimiter(limits, store, f"gateway-{name}", clock=clock)
        for name, store in zip("ab", stores, strict=True)
    }
    outcomes = []
    for at, name, call, group, tokens in STEPS:
        clock.now = at
        shared = gateways[name]
        if call == "enter":
            got, want = outcome(shared.enter, group), outcome(one.enter, group)
        elif call == "leave":
            shared.leave(group)
            one.leave(group)
            continue
        else:
            got = outcome(shared.charge_tokens, group, tokens)
            want = outcome(one.charge_tokens, group, tokens)
        assert got == want, (at, name, call)
        outcomes.append(got)
        # The reply's headers, from the gateway that served it: the group's, fleet-wide.
        assert headers(shared, group) == headers(one, group)
    assert [o and o[:2] for o in outcomes] == [
        None,
        None,
        (1, "requests"),
        None,
        None,
        (20, "requests"),
        (2, "requests"),
        None,
        None,
        (1, "tokens"),
        (60, "tokens"),
        None,
        (1, "tokens"),  # b took what had refilled
    ]
    assert "2 requests of this key group are running, its limit is 2 at once" in outcomes[2][2]  # type: ignore[index]
    assert "lower max_tokens" in outcomes[10][2]  # type: ignore[index]
    # Both gateways read the same group state at the same time: their headers agree.
    assert headers(gateways["a"], "g") == headers(gateways["b"], "g")
    assert headers(gateways["a"], "g")[b"x-ratelimit-remaining-tokens"] == b"0"
    assert headers(gateways["a"], "g")[b"x-ratelimit-reset-requests"] == b"58.5s"


def test_requests_per_minute_hold_for_the_pair_by_the_stores_clock_off_the_event_loop(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    """The gateway's own calls (admit, charge, release) on the store's clock: 5 a minute
    across both gateways; the 6th, on either, waits for the 12 s refill."""
    limits = GroupLimits(max_concurrent=8, requests_per_minute=5, tokens_per_minute=1000)
    a, b = (SharedRateLimiter(limits, s, f"gateway-{n}") for n, s in zip("ab", stores, strict=True))

    async def run() -> tuple[float, list[RateLimited], list[bytes]]:
        await a.start()
        await b.start()
        remaining = []
        start = time.monotonic()
        for gateway in (a, b, a, b, a):
            await gateway.admit("g")
            await gateway.charge("g", 100)
            remaining.append(dict(gateway.headers("g", anthropic=False)))
            gateway.release("g")
        refused = []
        for gateway in (a, b):
            with pytest.raises(RateLimited) as over:
                await gateway.admit("g")
            refused.append(over.value)
        elapsed = time.monotonic() - start
        await a.close()
        await b.close()
        return elapsed, refused, [h[b"x-ratelimit-remaining-requests"] for h in remaining]

    elapsed, refused, remaining = asyncio.run(run())
    assert remaining == [b"4", b"3", b"2", b"1", b"0"]  # each reply counts the other's
    for over in refused:
        assert "over this key group's 5 requests per minute" in over.message
        # 12 s for one request less what has refilled since the first (the store's clock).
        assert math.ceil(12 - elapsed) <= over.retry_after_s <= 12
    assert slots(stores[0], "gateway-a") == slots(stores[0], "gateway-b") == 0  # closed: cleared


def test_enters_at_once_on_both_gateways_admit_exactly_the_groups_limit(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    """Each enter of a group waits for the one before it on any gateway, and then counts
    what that one committed: 24 at once, 12 on each gateway, for a limit of 5."""
    clock = Clock(1000.0)
    limits = GroupLimits(max_concurrent=5, requests_per_minute=1000, tokens_per_minute=0)
    gateways = [
        SharedRateLimiter(limits, s, f"gateway-{n}", clock=clock)
        for n, s in zip("ab", stores, strict=True)
    ]
    barrier = threading.Barrier(24)

    def enter(limiter: SharedRateLimiter) -> bool:
        barrier.wait()
        return outcome(limiter.enter, "g") is None

    with ThreadPoolExecutor(24) as pool:
        admitted = list(pool.map(enter, gateways * 12))
    assert admitted.count(True) == 5
    assert LimitsStore(stores[0]).num_running("g", clock.now) == 5
    assert sum(g._num_held["g"] for g in gateways) == 5
    assert [g.local.num_running("g") for g in gateways] == [0, 0]  # the store answered all


def test_a_dead_gateways_running_requests_come_back_after_its_lease(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    clock = Clock(1000.0)
    limits = GroupLimits(max_concurrent=2, requests_per_minute=0, tokens_per_minute=0)
    a, b = (
        SharedRateLimiter(limits, s, f"gateway-{n}", clock=clock, lease_s=30)
        for n, s in zip("ab", stores, strict=True)
    )
    a.enter("g")
    a.enter("g")
    clock.now = 1020.0
    a.renew()  # alive: its leases run to 1050
    clock.now = 1049.0
    with pytest.raises(RateLimited, match="2 requests of this key group are running"):
        b.enter("g")
    # Gateway a dies here: no leave, no renewal. Its lease runs out at 1050.
    clock.now = 1050.5
    b.enter("g")
    b.enter("g")
    with pytest.raises(RateLimited, match="2 requests of this key group are running"):
        b.enter("g")  # b's own two hold the limit now
    assert LimitsStore(stores[0]).num_running("g", clock.now) == 2
    assert slots(stores[0], "gateway-a") == 1  # the dead gateway's row, no longer counted

    async def restart() -> int:
        again = SharedRateLimiter(limits, stores[0], "gateway-a", clock=clock, lease_s=30)
        await again.start()  # what gateway-a counted before it restarted ended with it
        found = slots(stores[0], "gateway-a")
        await again.close()
        return found

    assert asyncio.run(restart()) == 0


def test_a_store_that_cannot_be_reached_leaves_each_gateway_its_own_limits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Nothing listens on the port: every store call fails at once.
    dead = BatchStore(f"postgresql://tokenfleet:none@127.0.0.1:{free_port()}/none", migrate=False)
    clock = Clock(0.0)
    limits = GroupLimits(max_concurrent=1, requests_per_minute=2, tokens_per_minute=600)
    shared = SharedRateLimiter(limits, dead, "gateway-a", clock=clock, retry_s=5)
    one = RateLimiter(limits, clock)
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("enter", ("g",)),
        ("enter", ("g",)),  # over its concurrency of 1
        ("leave", ("g",)),
        ("enter", ("g",)),
        ("leave", ("g",)),
        ("enter", ("g",)),  # over its 2 requests a minute
        ("charge_tokens", ("g", 590)),
        ("charge_tokens", ("g", 20)),
    ]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = [outcome(getattr(shared, name), *args) for name, args in calls]
        clock.now = 6.0  # past retry_s: the store is tried again, and fails again
        got.append(outcome(shared.charge_tokens, "g", 70))
    clock.now = 0.0
    want = [outcome(getattr(one, name), *args) for name, args in calls]
    clock.now = 6.0
    want.append(outcome(one.charge_tokens, "g", 70))
    assert got == want
    assert [o and o[:2] for o in got] == [
        None,
        (1, "requests"),
        None,
        None,
        None,
        (30, "requests"),
        None,
        (1, "tokens"),
        None,
    ]
    assert headers(shared, "g") == headers(one, "g")
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1  # once for the outage, not once a request
    assert records[0].levelno == logging.WARNING
    assert records[0].getMessage().startswith("shared limits: the batch store did not answer")
    dead.close()


@contextmanager
def store_locked(url: str) -> Iterator[None]:
    """Another connection holds the store's write lock (SQLite) or the rate tables' locks
    (PostgreSQL) until the block ends."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(make_url(url).database or "", isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    engine = create_engine(engine_url(url))
    with engine.connect() as conn:
        conn.execute(text("LOCK TABLE rate_buckets, rate_slots IN ACCESS EXCLUSIVE MODE"))
        try:
            yield
        finally:
            conn.rollback()
    engine.dispose()


def impatient(url: str) -> str:
    """`url` whose connections give up on a lock after 0.2 s."""
    if url.startswith("sqlite"):
        return f"{url}?timeout=0.2"
    parsed = make_url(url)
    options = f"{parsed.query.get('options', '')} -c lock_timeout=200".strip()
    return parsed.update_query_dict({"options": options}).render_as_string(hide_password=False)


def test_a_locked_store_is_left_to_the_local_limits_until_it_answers_again(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(1000.0)
    limits = GroupLimits(max_concurrent=2, requests_per_minute=0, tokens_per_minute=0)
    with BatchStore(impatient(url)) as store, BatchStore(url) as other:
        shared = SharedRateLimiter(limits, store, "gateway-a", clock=clock, retry_s=5)
        counts = LimitsStore(other)
        shared.enter("g")  # counted in the store
        with caplog.at_level(logging.INFO, logger=LOGGER), store_locked(url):
            shared.enter("g")  # the store gives up on its lock: counted here
            assert shared.local.num_running("g") == 1
            shared.leave("g")  # one of the two ends: the store's count is owed
            shared.leave("g")  # the other: this gateway's own count
            assert shared.local.num_running("g") == 0
        assert counts.num_running("g", clock.now) == 1  # the owed leave is not in yet
        clock.now += 5  # past retry_s
        with caplog.at_level(logging.INFO, logger=LOGGER):
            shared.renew()  # reaches the store: the owed leave with it
        assert counts.num_running("g", clock.now) == 0
        shared.enter("g")
        assert (counts.num_running("g", clock.now), shared.local.num_running("g")) == (1, 0)
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert [level for level, _ in messages] == [logging.WARNING, logging.INFO]
    assert messages[0][1].startswith("shared limits: the batch store did not answer")
    assert messages[1][1] == "shared limits: the batch store answers again"


def test_a_check_not_answered_in_time_is_made_locally_and_its_late_count_undone(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that hangs (a lock it waits for): the request is admitted by the gateway's
    own limits after check_timeout_s; once the store's enter lands, it is counted down."""
    clock = Clock(1000.0)
    limits = GroupLimits(max_concurrent=1, requests_per_minute=0, tokens_per_minute=0)
    with BatchStore(url) as store:
        shared = SharedRateLimiter(limits, store, "gateway-a", clock=clock, check_timeout_s=0.3)
        counts = LimitsStore(store)

        async def run() -> None:
            with store_locked(url):
                await shared.admit("g")
                assert shared.local.num_running("g") == 1
            # The store's late enter lands, and is counted down again.
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    shared._down_until is None  # the store answered the late enter
                    and shared._num_held["g"] == 0
                    and counts.num_running("g", clock.now) == 0
                ),
                60,
                "the late enter counted down",
            )
            shared.release("g")
            await shared.close()

        with caplog.at_level(logging.WARNING, logger=LOGGER):
            asyncio.run(run())
        assert shared.local.num_running("g") == 0
        assert counts.num_running("g", clock.now) == 0
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert "no answer within 0.3 s" in record.getMessage()


def test_limits_are_shared_by_default_when_the_store_is_postgresql() -> None:
    postgres = BatchConfig(database_url="postgresql://tokenfleet@127.0.0.1/tokenfleet")
    assert ServeConfig(batch=postgres).limits_shared
    assert not ServeConfig().limits_shared  # SQLite: one gateway's store
    assert not ServeConfig(batch=postgres, shared_limits=False).limits_shared
    assert ServeConfig(shared_limits=True).limits_shared
    flag = [
        build_parser().parse_args(["serve", *a]).shared_limits
        for a in ([], ["--shared-limits"], ["--no-shared-limits"])
    ]
    assert flag == [None, True, False]


# -- end to end ------------------------------------------------------------------------------


KEYS = "alpha-1 alpha\nalpha-2 alpha\nbeta-1 beta\n"


@pytest.mark.fake("runner")
def test_two_gateways_on_one_postgresql_allow_a_group_its_requests_once_fixed_runner(
    tmp_path: Path, postgres_url: str
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    common = ["--runner", "fixed", "--database-url", postgres_url, "--api-keys-file", str(keys)]
    common += ["--requests-per-minute-per-group", "5"]  # shared: the store is PostgreSQL
    with (
        live_server(tmp_path, *common, "--gateway-id", "gateway-a") as a,
        live_server(tmp_path, *common, "--gateway-id", "gateway-b") as b,
    ):
        start = time.monotonic()
        remaining = []
        for server, key in ((a, "alpha-1"), (b, "alpha-2"), (a, "alpha-2"), (b, "alpha-1")) * 2:
            gpt = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            try:
                raw = gpt.chat.completions.with_raw_response.create(
                    model=MODEL, max_tokens=1, messages=USER
                )
            except openai.RateLimitError as exc:
                remaining.append(exc.response.headers["x-ratelimit-remaining-requests"])
                refused = exc
                break
            remaining.append(raw.headers["x-ratelimit-remaining-requests"])
        elapsed = time.monotonic() - start
        # Five in all, across both gateways; each reply counted the other gateway's.
        assert remaining == ["4", "3", "2", "1", "0", "0"]
        assert refused.body["type"] == "requests"  # type: ignore[index]
        retry_after = int(refused.response.headers["retry-after"])
        assert math.ceil(12 - elapsed) <= retry_after <= 12
        # The other gateway refuses the group too, in the Anthropic API's format...
        claude = anthropic.Anthropic(base_url=a.url, api_key="alpha-1", max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as limited:
            claude.messages.create(model=MODEL, max_tokens=1, messages=USER)
        assert limited.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
        assert limited.value.response.headers["anthropic-ratelimit-requests-limit"] == "5"
        # ... while another group has its own allowance.
        beta = anthropic.Anthropic(base_url=b.url, api_key="beta-1", max_retries=0)
        reply = beta.messages.with_raw_response.create(model=MODEL, max_tokens=1, messages=USER)
        assert reply.headers["anthropic-ratelimit-requests-remaining"] == "4"
