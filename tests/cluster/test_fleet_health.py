"""Slow and silent replicas as one gateway judges them: the slow rule's arithmetic over
windows fed by hand (standing in for the replicas' beats: cluster/health.py), and the
silence rules through FleetClient over in-process replicas whose beats a stand-in for a
network cut drops (the replica's process itself runs on)."""

from __future__ import annotations

import asyncio

import pytest
from support.local_fleet import collect, fleet, request, until

from tokenfleet.cluster.client import FleetClient
from tokenfleet.cluster.health import (
    ALPHA,
    PROBE_WINDOWS,
    SLOW_AFTER_WINDOWS,
    SLOW_WITHIN_WINDOWS,
    FleetHealth,
    SlowRule,
)
from tokenfleet.cluster.wire import FleetMessage
from tokenfleet.config import EngineConfig, FleetConfig

# -- the slow rule, windows fed by hand ------------------------------------------------------


def feed(health: FleetHealth, windows: dict[int, float | None], times: int = 1) -> None:
    for _ in range(times):
        for replica_id, step_ms in windows.items():
            health.window(replica_id, step_ms)


@pytest.mark.fake("beats")
def test_windows_fed_by_hand_a_replica_3x_slower_is_slow_within_the_stated_windows() -> None:
    """Three replicas at 10 ms a step; one goes to 30 ms: its average is over 2 x 10
    from its 2nd window of the new pace, and it is slow at its SLOW_AFTER_WINDOWS-th
    (each window over the bar), within SLOW_WITHIN_WINDOWS; the others never are. Its row
    shows its average and the others' median."""
    health = FleetHealth(SlowRule(2.0))
    feed(health, {0: 10.0, 1: 10.0, 2: 10.0}, times=5)
    assert health.num_slow == 0
    became = [health.window(0, 30.0) for _ in range(SLOW_AFTER_WINDOWS + 1)]
    assert became == [None] * (SLOW_AFTER_WINDOWS - 1) + [True, None]
    assert SLOW_AFTER_WINDOWS <= SLOW_WITHIN_WINDOWS
    assert health.is_slow(0) and not health.is_slow(1) and not health.is_slow(2)
    assert health.describe(0) == {
        "step_ms_avg": round(10 + (1 - (1 - ALPHA) ** (SLOW_AFTER_WINDOWS + 1)) * 20, 3),
        "step_ms_median": 10.0,
        "step_windows": 5 + SLOW_AFTER_WINDOWS + 1,
        "slow_at_window": 5 + SLOW_AFTER_WINDOWS,
    }
    assert health.num_slow == 1 and health.num_became_slow == 1


@pytest.mark.fake("beats")
def test_windows_fed_by_hand_a_slow_replica_recovers_only_under_the_recovery_band() -> None:
    """Factor 2, recovery 1.5 (midway): back at 10 ms a step, the slow replica stays slow
    while its average is above 15 ms (no flapping at the factor's edge), and is ready
    once under it; an average between the two bands keeps whatever state it has."""
    health = FleetHealth(SlowRule(2.0))
    feed(health, {0: 10.0, 1: 10.0, 2: 10.0}, times=3)
    feed(health, {0: 30.0}, times=10)  # average ~29.9
    assert health.is_slow(0)
    states = []
    for _ in range(8):
        health.window(0, 10.0)
        states.append((round(health.replicas[0].average_ms or 0, 1), health.is_slow(0)))
    # 29.9 -> 21.9 -> 17.2 (under 2 x 10, still slow) -> 14.3 (<= 15: ready) ...
    assert [s for _, s in states[:3]] == [True, True, False]
    first_ready = next(i for i, (_, slow) in enumerate(states) if not slow)
    assert states[first_ready][0] <= 15.0 < states[first_ready - 1][0]
    assert all(not slow for _, slow in states[first_ready:])
    # Between the bands (18 ms: under 2 x 10, over 1.5 x 10): a ready one stays ready.
    feed(health, {0: 18.0}, times=20)
    assert not health.is_slow(0)


@pytest.mark.fake("beats")
def test_windows_fed_by_hand_one_replica_alone_is_never_slow_and_two_compare_each_other() -> None:
    """The median is of the *other* replicas: alone, a replica at any pace is not slow;
    of two, the one 3x slower is slow (against the plain median of both, 20 ms, it would
    not be: 30 < 2 x 20) and the faster never is."""
    alone = FleetHealth(SlowRule(2.0))
    feed(alone, {0: 500.0}, times=10)
    assert not alone.is_slow(0) and alone.describe(0)["step_ms_median"] is None
    two = FleetHealth(SlowRule(2.0))
    feed(two, {0: 10.0, 1: 30.0}, times=10)
    assert (two.is_slow(0), two.is_slow(1)) == (False, True)
    assert two.describe(1)["step_ms_median"] == 10.0


@pytest.mark.fake("beats")
def test_windows_fed_by_hand_the_rule_off_marks_nothing_slow() -> None:
    """--slow-replica-factor 0 (or None): no replica is ever slow, however slow; the
    averages are still shown; a factor of 1 or less is refused (it would mark about half
    the fleet slow)."""
    for off in (SlowRule(0), SlowRule(None)):
        health = FleetHealth(off)
        feed(health, {0: 10.0, 1: 10.0, 2: 100.0}, times=20)
        assert health.num_slow == 0
        assert health.describe(2)["step_ms_avg"] == pytest.approx(100.0)
        assert health.describe_fleet()["slow_replica_factor"] is None
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="over 1"):
            SlowRule(bad)
    with pytest.raises(ValueError, match="recovery factor"):
        SlowRule(2.0, recover=2.5)


@pytest.mark.fake("beats")
def test_windows_fed_by_hand_a_slow_replica_without_work_is_put_on_probation() -> None:
    """Slow and given no new work, a replica has nothing to measure: its windows without a
    step leave it slow until PROBE_WINDOWS of them in a row, then it is ready with its
    average forgotten; measured slow again, it is slow again."""
    health = FleetHealth(SlowRule(2.0))
    feed(health, {0: 10.0, 1: 10.0, 2: 10.0}, times=3)
    feed(health, {0: 40.0}, times=SLOW_AFTER_WINDOWS)
    assert health.is_slow(0)
    feed(health, {0: None}, times=PROBE_WINDOWS - 1)
    assert health.is_slow(0)
    assert health.window(0, None) is False
    assert health.describe(0)["step_ms_avg"] is None
    again = [health.window(0, 40.0) for _ in range(SLOW_AFTER_WINDOWS)]
    assert again == [None] * (SLOW_AFTER_WINDOWS - 1) + [True]


@pytest.mark.fake("beats")
def test_windows_fed_by_hand_one_window_of_a_stall_does_not_make_a_replica_slow() -> None:
    """One window at 10x (the machine busy for a moment) lifts the average past 2 x the
    median, but the next window is back at the pace: not slow; nor is a stall one window
    short of SLOW_AFTER_WINDOWS. That many windows in a row are."""
    health = FleetHealth(SlowRule(2.0))
    feed(health, {0: 10.0, 1: 10.0, 2: 10.0}, times=5)
    assert [health.window(0, ms) for ms in (100.0, 10.0, 10.0)] == [None, None, None]
    # The average alone would have been over the bar all three windows (46, 31.6, 22.96).
    average = health.replicas[0].average_ms
    assert average == pytest.approx(10 + 90 * ALPHA * (1 - ALPHA) ** 2) and average > 20
    feed(health, {0: 10.0}, times=10)
    stall = [health.window(0, 100.0) for _ in range(SLOW_AFTER_WINDOWS - 1)]
    assert [*stall, health.window(0, 10.0)] == [None] * SLOW_AFTER_WINDOWS
    feed(health, {0: 10.0}, times=10)
    stall = [health.window(0, 100.0) for _ in range(SLOW_AFTER_WINDOWS)]
    assert stall == [None] * (SLOW_AFTER_WINDOWS - 1) + [True]


# -- silence, through FleetClient (a network cut stood in for) ------------------------------


def cut(client: FleetClient, replica_id: int) -> list[FleetMessage]:
    """Stand in for a network cut of the replica's messages to the gateway: they are held
    (returned) instead of read; `heal` reads them late, then lets the rest through."""
    held: list[FleetMessage] = []
    received = client._received

    def cut_off(message: FleetMessage) -> None:
        if message.replica_id == replica_id and not getattr(client, "_healed", False):
            held.append(message)
        else:
            received(message)

    client._received = cut_off  # type: ignore[method-assign]
    return held


def heal(client: FleetClient, held: list[FleetMessage]) -> None:
    client._healed = True  # type: ignore[attr-defined]
    for message in held:
        client._received(message)


@pytest.mark.fake("network")
def test_a_replica_cut_off_past_the_replica_timeout_has_its_requests_moved_and_serves_again(
    config: EngineConfig, fixed_token: int
) -> None:
    """Cut off (stand-in) for more than the replica timeout but less than the fence
    timeout: its requests move with their tokens (each stream exact), it is shown
    `silent` and gets no new work; when its messages come through again, late, what it
    sent of the moved attempts is dropped (counted), and it is ready under the same
    incarnation, with no restart asked."""

    async def run() -> None:
        async with fleet(config, 2, replica_timeout_s=0.5, fence_timeout_s=30.0) as f:
            streams = [await f.client.submit(request(f"r{n}", 1000)) for n in range(4)]
            tasks = [asyncio.create_task(collect(f, s)) for s in streams]
            await until(
                lambda: all(len(f.collected.get(s.req_id, [])) >= 10 for s in streams),
                "10 tokens each",
            )
            victim = f.link_of("r0")
            link = f.client.links[victim]
            incarnation = link.incarnation
            held = cut(f.client, victim)
            await until(lambda: link.shown_state == "silent", "the replica silent")
            assert f.client.num_moves == 2 and not link.requests
            late = await f.client.submit(request("late", 20))
            assert f.link_of("late") == 1 - victim
            # The streams it had run on elsewhere; its late outputs of them are dropped.
            dropped = f.client.health.num_dropped
            heal(f.client, held)
            assert f.client.health.num_dropped > dropped
            assert await asyncio.gather(*tasks) == [[fixed_token] * 1000] * 4
            assert await collect(f, late) == [fixed_token] * 20
            await until(lambda: link.shown_state == "ready", "ready again")
            assert link.incarnation == incarnation and f.directory.restarts == []
            again = await f.client.submit(request("again", 20))
            assert await collect(f, again) == [fixed_token] * 20

    asyncio.run(run())


@pytest.mark.fake("network")
def test_a_replica_cut_off_past_the_fence_timeout_is_fenced_replaced_once_and_ignored(
    config: EngineConfig, fixed_token: int
) -> None:
    """Cut off past the fence timeout: `fenced`, its requests moved (exact streams), Ray
    asked to replace it once; its messages when the cut heals are dropped and counted,
    and do not bring it back (its incarnation is fenced)."""

    async def run() -> None:
        async with fleet(config, 2, replica_timeout_s=0.3, fence_timeout_s=0.8) as f:
            streams = [await f.client.submit(request(f"r{n}", 300)) for n in range(4)]
            tasks = [asyncio.create_task(collect(f, s)) for s in streams]
            await until(
                lambda: all(len(f.collected.get(s.req_id, [])) >= 10 for s in streams),
                "10 tokens each",
            )
            victim = f.link_of("r0")
            link = f.client.links[victim]
            held = cut(f.client, victim)
            await until(lambda: link.state == "fenced", "the replica fenced")
            assert await asyncio.gather(*tasks) == [[fixed_token] * 300] * 4
            await until(lambda: f.directory.restarts == [victim], "a replacement asked")
            assert f.client.health.num_fenced == 1
            dropped = f.client.health.num_dropped
            heal(f.client, held)
            assert f.client.health.num_dropped == dropped + len(held) > dropped
            await asyncio.sleep(0.3)
            assert link.state == "fenced" and f.directory.restarts == [victim]

    asyncio.run(run())


def test_the_fleet_config_refuses_a_fence_before_the_replica_timeout_and_a_factor_of_1() -> None:
    """`--fence-timeout` under `--replica-timeout` would fence before the requests move;
    a factor of 1 would mark about half the fleet slow: both refused, the defaults kept."""
    with pytest.raises(ValueError, match="fence timeout"):
        FleetConfig(replica_timeout_s=1.5, fence_timeout_s=1.0)
    with pytest.raises(ValueError, match="slow replica factor"):
        FleetConfig(slow_replica_factor=1.0)
    defaults = FleetConfig()
    assert (defaults.fence_timeout_s, defaults.slow_replica_factor) == (10.0, 2.0)
    assert FleetConfig(slow_replica_factor=None).slow_replica_factor is None
