"""The batch dispatcher's depth rule: keep the engine's batch queue just deep enough."""

from __future__ import annotations

from typing import Any

import pytest

from tokenfleet.fleet.leasing import lease_room


@pytest.mark.parametrize(
    ("in_flight", "engine_load", "room"),
    [
        (0, None, 8),  # before the engine reports: the queue target in all
        (8, None, 0),
        (8, (8, 0), 8),  # it runs all 8: lease 8 more to wait behind them
        (16, (8, 8), 0),  # 8 wait already: nothing more
        (20, (16, 4), 4),  # 16 run, 4 wait: top the queue up to 8
        (30, (40, 0), 18),  # the running count can run ahead of what was counted in flight
        (60, (60, 0), 4),  # the depth (64) caps what is in flight
        (70, (64, 6), 0),  # over the cap after a depth change: never negative
    ],
)
def test_lease_room_keeps_about_the_queue_target_waiting_and_never_passes_the_depth(
    in_flight: int, engine_load: tuple[int, int] | None, room: int
) -> None:
    assert lease_room(in_flight, engine_load, queue_target=8, depth=64) == room


@pytest.mark.fake("store")
def test_a_result_arriving_during_a_commit_is_committed_next_round_on_a_fake_store() -> None:
    """The last result must not wait for another completion that may never come. The
    store is a stand-in whose commit is held open until the second result is queued."""
    import asyncio
    import threading

    from tokenfleet.batch.schema import LeasedRequest
    from tokenfleet.server.dispatcher import BatchDispatcher, DispatcherConfig, ResultFormats

    committed: list[list[int]] = []
    in_commit, second_queued = threading.Event(), threading.Event()

    class SlowStore:
        def complete_many(self, outcomes: list[Any], now: float) -> int:
            in_commit.set()
            if not committed:  # the first commit lasts until the second result is queued
                assert second_queued.wait(60), "the second result never came"
            committed.append([o.idx for o in outcomes])
            return len(outcomes)

    def leased(idx: int) -> LeasedRequest:
        return LeasedRequest("msgbatch_1", idx, f"r{idx}", "{}", 1, 1, "/v1/messages", "anthropic")

    async def go() -> None:
        dispatcher = BatchDispatcher(
            SlowStore(),  # type: ignore[arg-type]
            DispatcherConfig(owner="g", commit_s=0.001),
            {},
            ResultFormats(),
        )
        first = asyncio.create_task(dispatcher._complete(leased(0), "succeeded", "{}"))
        while not in_commit.is_set():  # the first commit is now in flight
            await asyncio.sleep(0.001)
        second = asyncio.create_task(dispatcher._complete(leased(1), "succeeded", "{}"))
        while not dispatcher._outcomes:  # the second result waits for the next round
            await asyncio.sleep(0.001)
        second_queued.set()
        # Only a hang fails here (the bug: the second result waits for a third forever).
        await asyncio.wait_for(asyncio.gather(first, second), timeout=60)

    asyncio.run(go())
    assert committed == [[0], [1]]


@pytest.mark.fake("engine")
def test_an_idle_dispatcher_only_reads_and_finds_another_gateways_batch_on_a_fake_engine(
    tmp_path: Any,
) -> None:
    """With nothing running and no open batch, a tick is one read (no round of writes on
    the store's thread); a batch another gateway created (no wake here) is still found at
    the next idle tick, run, and ended. A real store (counted); the requests run on an echo
    function in place of the engine."""
    import asyncio
    import json
    import time
    from collections import Counter

    from tokenfleet.batch.schema import NewBatch, NewRequest
    from tokenfleet.batch.store import BatchStore
    from tokenfleet.server.dispatcher import BatchDispatcher, DispatcherConfig, ResultFormats

    store = BatchStore(f"sqlite:///{tmp_path / 'batches.db'}")
    calls: Counter[str] = Counter()

    class CountingStore:
        def __getattr__(self, name: str) -> Any:
            method = getattr(store, name)

            def counted(*args: Any) -> Any:
                calls[name] += 1
                return method(*args)

            return counted

    ran: list[dict[str, Any]] = []

    async def runner(params: dict[str, Any]) -> dict[str, Any]:
        ran.append(params)
        return {"echo": params["i"]}

    async def until(condition: Any, timeout_s: float = 60) -> None:  # only catches a hang
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, dict(calls)
            await asyncio.sleep(0.005)

    async def go() -> None:
        dispatcher = BatchDispatcher(
            CountingStore(),  # type: ignore[arg-type]
            DispatcherConfig(owner="g", poll_s=0.002, maintenance_s=0.01),  # idle: 40-ms ticks
            {"/v1/messages": runner},
            ResultFormats(),
        )
        await dispatcher.start()
        try:
            await until(lambda: calls["has_open_batches"] >= 4)
            # One archive pass at the first tick (hourly after that); nothing else.
            assert set(calls) == {"requeue_owner", "has_open_batches", "archive_batches"}
            assert calls["requeue_owner"] == calls["archive_batches"] == 1
            now = time.time()
            store.create_batch(  # as another gateway sharing the store would
                NewBatch("msgbatch_1", "anthropic", "alice", "/v1/messages", now, now + 3600),
                (NewRequest(f"r{i}", json.dumps({"i": i})) for i in range(3)),
            )
            await until(
                lambda: (
                    (b := store.get_batch_any_owner("msgbatch_1")) is not None
                    and b.state == "ended"
                )
            )
            assert sorted(p["i"] for p in ran) == [0, 1, 2]
            assert calls["lease"] >= 1 and calls["finish_batches"] >= 1
            # The round that ended it may still be leasing: count from the next tick's read.
            reads = calls["has_open_batches"]
            await until(lambda: calls["has_open_batches"] > reads)
            writes = sum(n for name, n in calls.items() if name != "has_open_batches")
            await until(lambda: calls["has_open_batches"] > reads + 4)
            # Idle again: reads only.
            assert sum(n for name, n in calls.items() if name != "has_open_batches") == writes
        finally:
            await dispatcher.stop()

    asyncio.run(go())
    results = list(store.iter_results("msgbatch_1"))
    assert sorted(json.loads(r.result)["message"]["echo"] for r in results) == [0, 1, 2]


@pytest.mark.fake("engine")
def test_a_batch_request_runs_in_its_owners_key_group_on_a_fake_engine(tmp_path: Any) -> None:
    """The group the runner sees (the service's prefix-cache salt, as for the owner's sync
    requests) is the batch owner's, for each of two owners' batches run side by side. A
    real store; the requests run on a function in place of the engine."""
    import asyncio
    import json
    import time

    from tokenfleet.batch.schema import NewBatch, NewRequest
    from tokenfleet.batch.store import BatchStore
    from tokenfleet.server.dispatcher import BatchDispatcher, DispatcherConfig, ResultFormats
    from tokenfleet.server.keys import CALLER_GROUP, Owners, owner_id

    store = BatchStore(f"sqlite:///{tmp_path / 'batches.db'}")
    owners = Owners([("key-a", "team-a"), ("key-b", "team-b")])
    seen: dict[str, str | None] = {}

    async def runner(params: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.01)  # the two owners' requests interleave
        seen[params["id"]] = CALLER_GROUP.get()
        return {}

    async def go() -> None:
        dispatcher = BatchDispatcher(
            store,
            DispatcherConfig(owner="g", poll_s=0.002),
            {"/v1/messages": runner},
            ResultFormats(),
            group_of=owners.group,
        )
        now = time.time()
        for key in ("key-a", "key-b"):
            store.create_batch(
                NewBatch(
                    f"msgbatch_{key}", "anthropic", owner_id(key), "/v1/messages", now, now + 60
                ),
                (NewRequest(f"r{i}", json.dumps({"id": f"{key}/{i}"})) for i in range(4)),
            )
        await dispatcher.start()
        try:
            deadline = time.monotonic() + 60  # only catches a hang
            while len(seen) < 8:
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.005)
        finally:
            await dispatcher.stop()

    asyncio.run(go())
    assert seen == {f"key-{k}/{i}": f"team-{k}" for k in "ab" for i in range(4)}


@pytest.mark.fake("engine")
def test_stop_ends_the_loop_even_when_a_wake_comes_with_the_cancel_on_a_fake_engine(
    tmp_path: Any,
) -> None:
    """A wake and stop()'s cancel in the same turn of the event loop (under load, a request
    that just finished wakes the loop as the gateway stops): the loop must still end, or
    stop() waits forever. A real store; no request runs."""
    import asyncio

    from tokenfleet.batch.store import BatchStore
    from tokenfleet.server.dispatcher import BatchDispatcher, DispatcherConfig, ResultFormats

    store = BatchStore(f"sqlite:///{tmp_path / 'batches.db'}")

    async def go() -> None:
        dispatcher = BatchDispatcher(store, DispatcherConfig(owner="g"), {}, ResultFormats())
        await dispatcher.start()
        loop_task = dispatcher._loop_task
        assert loop_task is not None
        for _ in range(20):  # idle: the loop is waiting for a wake or its poll
            await asyncio.sleep(0.01)
        dispatcher.wake()
        loop_task.cancel()  # as stop() does first
        done, _ = await asyncio.wait({loop_task}, timeout=10)
        assert done == {loop_task}, "the loop went on after its cancel"
        assert loop_task.cancelled()
        await dispatcher.stop()

    asyncio.run(go())


@pytest.mark.fake("engine")
def test_the_number_leased_follows_the_depth_read_at_each_lease_on_a_fake_engine(
    tmp_path: Any,
) -> None:
    """A fleet that grows and shrinks under the dispatcher: its depth (the capacity read at
    each lease) goes 4 -> 10 -> 3, and what is in flight follows, never past it; over the
    depth after the shrink, nothing is leased until enough have ended. A real store; each
    request runs on a function that holds it until the test lets it end, and the engine
    reports as running every request held."""
    import asyncio
    import json
    import time

    from tokenfleet.batch.schema import NewBatch, NewRequest
    from tokenfleet.batch.store import BatchStore
    from tokenfleet.server.dispatcher import BatchDispatcher, DispatcherConfig, ResultFormats

    store = BatchStore(f"sqlite:///{tmp_path / 'batches.db'}")
    now = time.time()
    store.create_batch(
        NewBatch("msgbatch_1", "anthropic", "alice", "/v1/messages", now, now + 3600),
        (NewRequest(f"r{i}", json.dumps({"i": i})) for i in range(20)),
    )
    held: dict[int, asyncio.Event] = {}  # running now, by request
    capacity = {"depth": 4, "reads": 0}
    committed = {"succeeded": 0}

    async def runner(params: dict[str, Any]) -> dict[str, Any]:
        held[params["i"]] = asyncio.Event()
        await held[params["i"]].wait()
        del held[params["i"]]
        return {"i": params["i"]}

    def read_capacity() -> tuple[int, int]:
        capacity["reads"] += 1
        return capacity["depth"], 2

    async def until(condition: Any, timeout_s: float = 60) -> None:  # only catches a hang
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, sorted(held)
            await asyncio.sleep(0.002)

    async def settled() -> int:
        """How many run once the dispatcher has read its capacity 10 more times (10 more
        chances to lease)."""
        reads = capacity["reads"]
        await until(lambda: capacity["reads"] >= reads + 10)
        return len(held)

    async def end(num: int) -> None:
        """Let `num` of the running requests end, and wait for their commits."""
        done = committed["succeeded"] + num
        for i in sorted(held)[:num]:
            held[i].set()
        await until(lambda: committed["succeeded"] == done)

    def counted(outcome: str, n: int) -> None:
        committed[outcome] = committed.get(outcome, 0) + n

    dispatcher = BatchDispatcher(
        store,
        DispatcherConfig(owner="g", poll_s=0.002, commit_s=0.001),
        {"/v1/messages": runner},
        ResultFormats(),
        capacity=read_capacity,
        engine_load=lambda: (len(held), 0),
        counted=counted,
    )

    async def go() -> list[int]:
        in_flight = []
        await dispatcher.start()
        try:
            await until(lambda: len(held) == 4)
            in_flight.append(await settled())  # 4: the depth
            capacity["depth"] = 10  # the fleet grew
            await until(lambda: len(held) == 10)
            in_flight.append(await settled())  # 10
            capacity["depth"] = 3  # the fleet shrank: 10 run, over the depth
            in_flight.append(await settled())  # 10: nothing leased, nothing stopped
            await end(5)
            in_flight.append(await settled())  # 5: still over the depth
            await end(2)
            in_flight.append(await settled())  # 3: at the depth, nothing more
            await end(1)
            in_flight.append(await settled())  # 3: one more leased in the place of one
            assert store.request_counts("msgbatch_1")["leased"] == 3
            capacity["depth"] = 64  # the rest
            while committed["succeeded"] < 20:
                await until(lambda: held)
                await end(len(held))
        finally:
            await dispatcher.stop()
        return in_flight

    assert asyncio.run(go()) == [4, 10, 10, 5, 3, 3]
    assert committed == {"succeeded": 20}  # none released, errored or run twice
    counts = store.request_counts("msgbatch_1")
    assert (counts["succeeded"], counts["leased"], counts["queued"]) == (20, 0, 0)
    results = [json.loads(r.result)["message"]["i"] for r in store.iter_results("msgbatch_1")]
    assert sorted(results) == list(range(20))


@pytest.mark.fake("client")
@pytest.mark.parametrize(
    ("states", "capacity"),
    [
        (["ready"], (16, 4)),  # one engine: its sequence slots, queue target at least 4
        (["starting"], (16, 4)),  # one engine always counts one (it leases only when ready)
        (["ready", "ready"], (32, 4)),
        (["ready"] * 4, (64, 8)),  # grown to 4: the queue target an eighth of the depth
        # Scaled back to 2: the ones leaving, coming or down take no new work.
        (["ready", "ready", "draining", "starting", "silent", "fenced", "dead"], (32, 4)),
        (["ready", "slow", "slow"], (16, 4)),  # slow ones take work only when none is ready
        (["slow", "slow", "draining"], (32, 4)),
    ],
)
def test_the_batch_capacity_counts_the_replicas_taking_work_now_on_a_fake_client(
    states: list[str], capacity: tuple[int, int]
) -> None:
    """The gateway's rule for the dispatcher's capacity, over GET /admin/fleet's rows of a
    stand-in client with 16 sequence slots per replica."""
    from types import SimpleNamespace

    from tokenfleet.server.batch_start import batch_capacity

    client = SimpleNamespace(
        config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=16)),
        describe=lambda: [{"id": i, "state": s} for i, s in enumerate(states)],
    )
    assert batch_capacity(client) == capacity  # type: ignore[arg-type]
