"""The autoscaler's policy (fleet/autoscaler.py), window by scripted window: why it scales
up, how far, when it may not (replicas starting, cool-downs, bounds), when it scales down,
and the `--autoscale MIN:MAX` flag's parsing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.fleet.autoscaler import (
    Autoscaler,
    AutoscalerConfig,
    AutoscalerState,
    BatchRateMeter,
    FleetWindow,
    ScaleDecision,
    batch_replicas_needed,
    parse_autoscale,
    target_replicas,
)


def window(now_s: float = 0.0, **kw: Any) -> FleetWindow:
    """A calm window of 10 ready replicas, changed by `kw`."""
    values: dict[str, Any] = {
        "num_replicas": 10,
        "num_starting": 0,
        "slo_attainment": 0.995,
        "queued_prefill_tokens": 0,
        "batch_tokens_left": 0,
        "batch_time_left_s": 0.0,
        "batch_tokens_per_replica_s": 0.0,
    }
    values.update(kw)
    return FleetWindow(now_s=now_s, **values)


def decide(config: AutoscalerConfig, w: FleetWindow) -> tuple[int, str]:
    decision, _ = target_replicas(w, config, AutoscalerState())
    return decision.target, decision.reason


def reasons(scaler: Autoscaler) -> list[tuple[float, int, str]]:
    return [(d.now_s, d.target, d.reason) for d in scaler.history]


CONFIG = AutoscalerConfig(min_replicas=2, max_replicas=40)


def test_low_slo_attainment_adds_a_tenth_of_the_ready_replicas() -> None:
    assert decide(CONFIG, window(num_replicas=20, slo_attainment=0.94)) == (22, "slo")
    assert decide(CONFIG, window(num_replicas=5, slo_attainment=0.5)) == (6, "slo")  # at least 1
    # slo_low itself is not at risk; no finished request is no signal.
    assert decide(CONFIG, window(slo_attainment=0.95)) == (10, "hold")
    assert decide(CONFIG, window(slo_attainment=None)) == (10, "hold")


def test_a_long_prefill_queue_per_replica_scales_up() -> None:
    assert decide(CONFIG, window(queued_prefill_tokens=10 * 8192 + 1)) == (11, "queue")
    assert decide(CONFIG, window(queued_prefill_tokens=10 * 8192)) == (10, "hold")
    # Low attainment and a long queue together: the SLO is named.
    assert decide(CONFIG, window(slo_attainment=0.9, queued_prefill_tokens=10**6)) == (11, "slo")


def test_batch_that_would_miss_its_deadline_scales_up_to_the_exact_count_needed() -> None:
    # 1e6 tokens, 1000 s left, planned in half of it, 100 tokens/s a replica: 20 replicas.
    late = {"batch_time_left_s": 1000.0, "batch_tokens_per_replica_s": 100.0}
    assert decide(CONFIG, window(batch_tokens_left=1_000_000, **late)) == (20, "deadline")
    assert decide(CONFIG, window(batch_tokens_left=1_000_001, **late)) == (21, "deadline")
    # Needing exactly the fleet there is: hold (and no calm window either).
    w = window(batch_tokens_left=500_000, **late)
    assert batch_replicas_needed(w, CONFIG) == 10
    decision, state = target_replicas(w, CONFIG, AutoscalerState(calm_windows=4))
    assert (decision.target, decision.reason, state.calm_windows) == (10, "hold", 0)
    # The deadline's count wins over the SLO's step when larger, and the reverse.
    assert decide(CONFIG, window(slo_attainment=0.5, batch_tokens_left=1_000_000, **late)) == (
        20,
        "deadline",
    )
    assert decide(CONFIG, window(slo_attainment=0.5, batch_tokens_left=550_000, **late)) == (
        11,
        "slo",
    )
    # Nothing measured yet (no rate): hold rather than guess.
    assert decide(CONFIG, window(batch_tokens_left=10**9, batch_time_left_s=10.0)) == (10, "hold")


def test_a_replica_still_starting_is_not_asked_for_twice() -> None:
    scaler = Autoscaler(AutoscalerConfig(up_cooldown_s=0.0))
    assert scaler.decide(window(60.0, slo_attainment=0.9)) == 11
    # The one asked for is starting: the same bad signal adds nothing.
    assert scaler.decide(window(120.0, num_replicas=11, num_starting=1, slo_attainment=0.9)) == 11
    assert (
        scaler.decide(window(180.0, num_replicas=11, num_starting=1, queued_prefill_tokens=10**6))
        == 11
    )
    # Ready now, and latency still at risk: up again, by a tenth of the 11 ready.
    assert scaler.decide(window(240.0, num_replicas=11, slo_attainment=0.9)) == 12
    # The deadline's count includes the starting replicas: to 20 in all, not 20 more.
    late = {"batch_time_left_s": 1000.0, "batch_tokens_per_replica_s": 100.0}
    assert (
        scaler.decide(
            window(300.0, num_replicas=12, num_starting=1, batch_tokens_left=10**6, **late)
        )
        == 20
    )
    assert reasons(scaler) == [
        (60.0, 11, "slo"),
        (120.0, 11, "starting"),
        (180.0, 11, "starting"),
        (240.0, 12, "slo"),
        (300.0, 20, "deadline"),
    ]


def test_cooldowns_are_honoured_to_the_second() -> None:
    scaler = Autoscaler(AutoscalerConfig(up_cooldown_s=90.0, down_cooldown_s=300.0, down_windows=1))
    assert scaler.decide(window(0.0, slo_attainment=0.9)) == 11
    assert scaler.decide(window(89.0, num_replicas=11, slo_attainment=0.9)) == 11
    assert scaler.decide(window(90.0, num_replicas=11, slo_attainment=0.9)) == 12
    # Calm from here on: no down until 300 s after the change at 90 s.
    assert scaler.decide(window(389.0, num_replicas=12)) == 12
    assert scaler.decide(window(390.0, num_replicas=12)) == 11
    # A down is a change too: the next up waits 90 s from it.
    assert scaler.decide(window(479.0, num_replicas=11, slo_attainment=0.9)) == 11
    assert scaler.decide(window(480.0, num_replicas=11, slo_attainment=0.9)) == 12
    assert reasons(scaler) == [
        (0.0, 11, "slo"),
        (89.0, 11, "cooldown"),
        (90.0, 12, "slo"),
        (389.0, 12, "cooldown"),
        (390.0, 11, "calm"),
        (479.0, 11, "cooldown"),
        (480.0, 12, "slo"),
    ]


def test_no_scale_down_on_one_good_window_after_an_up_only_after_the_calm_run() -> None:
    scaler = Autoscaler(AutoscalerConfig(min_replicas=2, max_replicas=40))  # 5 calm windows
    targets = [scaler.decide(window(0.0, slo_attainment=0.9))]
    targets.append(scaler.decide(window(60.0, num_replicas=11, num_starting=1)))
    targets += [scaler.decide(window(60.0 * i, num_replicas=11)) for i in range(2, 7)]
    assert targets == [11, 11, 11, 11, 11, 11, 10]
    assert scaler.history[-1] == ScaleDecision(360.0, 11, 0, 10, "calm")
    # After a down the calm run starts over; a window between slo_low and slo_high breaks it.
    band = [scaler.decide(window(360.0 + 60 * i, num_replicas=10)) for i in range(1, 5)]
    band.append(scaler.decide(window(660.0, slo_attainment=0.97)))
    band += [scaler.decide(window(660.0 + 60 * i)) for i in range(1, 6)]
    assert band == [10] * 9 + [9]
    assert scaler.state == AutoscalerState(0, 960.0)


def test_scale_down_waits_for_both_interactive_and_batch_to_be_safe() -> None:
    config = AutoscalerConfig(down_windows=1, down_cooldown_s=0.0)
    assert decide(config, window()) == (9, "calm")
    # A prefill queue over a quarter of its limit is not calm.
    assert decide(config, window(queued_prefill_tokens=10 * 2049)) == (10, "hold")
    assert decide(config, window(queued_prefill_tokens=10 * 2048)) == (9, "calm")
    # Batch needing all ten: hold; needing nine: down to nine.
    late = {"batch_time_left_s": 1000.0, "batch_tokens_per_replica_s": 100.0}
    assert decide(config, window(batch_tokens_left=500_000, **late)) == (10, "hold")
    assert decide(config, window(batch_tokens_left=450_000, **late)) == (9, "calm")


def test_min_and_max_bound_every_target() -> None:
    config = AutoscalerConfig(min_replicas=2, max_replicas=12, down_windows=1)
    # Latency at risk at the maximum: held there, and said so.
    assert decide(config, window(num_replicas=12, slo_attainment=0.5)) == (12, "limit")
    # The deadline's count is cut to the maximum.
    late = {"batch_time_left_s": 1000.0, "batch_tokens_per_replica_s": 100.0}
    assert decide(config, window(batch_tokens_left=10**7, **late)) == (12, "deadline")
    # Calm at the minimum: never below it.
    assert decide(config, window(num_replicas=2)) == (2, "hold")
    # A fleet outside the bounds is brought inside at once, cool-down or not.
    recent = AutoscalerState(0, last_change_s=0.0)
    for n, bound in ((30, 12), (1, 2)):
        decision, _ = target_replicas(window(1.0, num_replicas=n), config, recent)
        assert (decision.target, decision.reason) == (bound, "limit")
    # Below the minimum with the deadline wanting more: straight to what it wants.
    assert decide(config, window(num_replicas=1, batch_tokens_left=200_000, **late)) == (
        4,
        "deadline",
    )


def test_autoscaler_refuses_a_window_older_than_the_last() -> None:
    scaler = Autoscaler(CONFIG)
    scaler.decide(window(100.0))
    with pytest.raises(ValueError, match=r"window at 99.0 s is before the last one \(100.0 s\)"):
        scaler.decide(window(99.0))


def test_windows_and_configs_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="num_starting <= num_replicas"):
        window(num_replicas=2, num_starting=3)
    with pytest.raises(ValueError, match="up_cooldown_s"):
        AutoscalerConfig(up_cooldown_s=-1.0)
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        AutoscalerConfig(min_replicas=5, max_replicas=4)
    with pytest.raises(ValueError, match="batch_settle_s must be >= 0"):
        AutoscalerConfig(batch_settle_s=-1.0)


def test_batch_rate_is_measured_over_fed_windows_settled_since_the_last_change() -> None:
    meter = BatchRateMeter(settle_s=20.0)
    # (window end, tokens made in it, batch requests queued at its end, replicas ready)
    script = [
        (10.0, 0, 0, 2),  # no batch
        (20.0, 500, 40, 2),  # a job arrived within it: fed from 20 s
        (30.0, 1000, 40, 2),  # settling (20 + 20 > 20)
        (40.0, 1000, 40, 2),  # settling (40 > 30)
        (50.0, 1200, 40, 2),  # measured: 1200 / 2 replicas / 10 s
        (60.0, 600, 40, 3),  # a third replica: fed again from 60 s
        (70.0, 1500, 40, 3),
        (80.0, 1500, 40, 3),
        (90.0, 1800, 40, 3),  # settled again
        (100.0, 900, 0, 3),  # the tail: every request on a replica
        (110.0, 1800, 10, 3),  # a new job: fed from 110 s
    ]
    rates = [meter.close(end - 10.0, end, tokens, q, r) for end, tokens, q, r in script]
    assert rates == [0, 0, 0, 0, 60.0, 0, 0, 0, 60.0, 0, 0]
    assert meter.rate(110.0, 110.0, 100, 10, 3) == 0.0  # an empty window measures nothing


def test_parse_autoscale_reads_min_and_max() -> None:
    assert parse_autoscale("2:8") == (2, 8)
    assert parse_autoscale("3:3") == (3, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("8", r"--autoscale wants MIN:MAX \(e.g. 2:8\), got '8'"),
        ("2:8:9", r"--autoscale wants MIN:MAX \(e.g. 2:8\), got '2:8:9'"),
        ("", r"--autoscale wants MIN:MAX \(e.g. 2:8\), got ''"),
        ("two:8", r"--autoscale wants two whole numbers MIN:MAX \(e.g. 2:8\), got 'two:8'"),
        ("2:", r"--autoscale wants two whole numbers MIN:MAX \(e.g. 2:8\), got '2:'"),
        ("1.5:4", r"whole numbers"),
        ("0:4", r"--autoscale MIN must be at least 1, got 0"),
        ("-1:4", r"--autoscale MIN must be at least 1, got -1"),
        ("5:2", r"--autoscale MAX must be at least MIN, got '5:2'"),
    ],
)
def test_parse_autoscale_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_autoscale(text)


# -- properties ---------------------------------------------------------------------------


@st.composite
def cases(draw: st.DrawFn) -> tuple[FleetWindow, AutoscalerConfig, AutoscalerState]:
    low = draw(st.integers(1, 20))
    config = AutoscalerConfig(
        min_replicas=low,
        max_replicas=draw(st.integers(low, 60)),
        down_windows=draw(st.integers(1, 4)),
        up_cooldown_s=draw(st.sampled_from([0.0, 30.0, 90.0])),
        down_cooldown_s=draw(st.sampled_from([0.0, 60.0, 300.0])),
    )
    n = draw(st.integers(0, 80))
    w = FleetWindow(
        now_s=draw(st.floats(0.0, 1000.0)),
        num_replicas=n,
        num_starting=draw(st.integers(0, n)),
        slo_attainment=draw(st.none() | st.floats(0.0, 1.0)),
        queued_prefill_tokens=draw(st.integers(0, 10**6)),
        batch_tokens_left=draw(st.integers(0, 10**8)),
        batch_time_left_s=draw(st.floats(-100.0, 86_400.0)),
        batch_tokens_per_replica_s=draw(st.floats(0.0, 5000.0)),
    )
    state = AutoscalerState(
        calm_windows=draw(st.integers(0, 6)),
        last_change_s=draw(st.none() | st.floats(-1000.0, 1000.0)),
    )
    return w, config, state


@settings(max_examples=500, deadline=None)
@given(cases())
def test_the_target_stays_in_bounds_and_never_drops_while_either_needs_more(
    case: tuple[FleetWindow, AutoscalerConfig, AutoscalerState],
) -> None:
    w, config, state = case
    decision, _ = target_replicas(w, config, state)
    n, target = w.num_replicas, decision.target
    assert config.min_replicas <= target <= config.max_replicas
    if target < n and n <= config.max_replicas:
        # Only a calm window scales down: interactive safe and batch needing no more.
        attainment = 1.0 if w.slo_attainment is None else w.slo_attainment
        assert attainment >= config.slo_high
        assert batch_replicas_needed(w, config) <= target
        assert (decision.reason, target) == ("calm", n - 1)
    if target > n and n >= config.min_replicas and w.num_starting:
        assert decision.reason == "deadline"  # pressure alone adds nothing while starting


def test_autoscaler_scales_up_at_once_and_down_only_after_calm_windows() -> None:
    config = AutoscalerConfig(min_replicas=2, max_replicas=40, down_windows=3)
    state = AutoscalerState()
    assert target_replicas(window(slo_attainment=0.9), config, state)[0].target == 11
    assert target_replicas(window(queued_prefill_tokens=10 * 9000), config, state)[0].target == 11
    # 1e6 tokens in 1000 s at half the time: 2000 tokens/s, 100 a replica: 20 replicas.
    batch = window(
        batch_tokens_left=1_000_000, batch_time_left_s=1000, batch_tokens_per_replica_s=100
    )
    assert target_replicas(batch, config, state)[0].target == 20
    targets = []
    for _ in range(4):
        decision, state = target_replicas(window(), config, state)
        targets.append(decision.target)
    assert targets == [10, 10, 9, 10]
    # Between slo_low and slo_high: neither up nor a calm window.
    decision, state = target_replicas(window(slo_attainment=0.97), config, AutoscalerState(2))
    assert (decision.target, decision.reason, state) == (10, "hold", AutoscalerState(0))
