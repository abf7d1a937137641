"""The batch dispatcher's depth rule: keep the engine's batch queue just deep enough."""

from __future__ import annotations

import pytest

from tokenfleet.server.dispatcher import lease_room


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


def test_a_result_that_arrives_during_a_commit_is_committed_in_the_next_round() -> None:
    """The last result must not wait for another completion that may never come."""
    import asyncio
    import threading
    import time
    from typing import Any

    from tokenfleet.batch.schema import LeasedRequest
    from tokenfleet.server.dispatcher import BatchDispatcher, DispatcherConfig, ResultFormats

    committed: list[list[int]] = []
    in_commit = threading.Event()

    class SlowStore:
        def complete_many(self, outcomes: list[Any], now: float) -> int:
            in_commit.set()
            time.sleep(0.05)
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
        await asyncio.wait_for(asyncio.gather(first, second), timeout=5)

    asyncio.run(go())
    assert committed == [[0], [1]]
