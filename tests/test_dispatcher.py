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
