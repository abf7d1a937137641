"""The autoscaler's policy: a pure function from a window of fleet metrics to a replica
count, with hysteresis.

    up   at once  when interactive SLO attainment < slo_low, or queued interactive prefill
                  per replica > max_queued_prefill_per_replica: +max(1, up_fraction x n)
    up   at once  to what the batch backlog needs to finish by its deadline at the batch
                  throughput measured per replica (with deadline_safety to spare)
    down slowly   by one, only after `down_windows` windows in a row with attainment >=
                  slo_high, prefill queues short and the backlog needing fewer

The gap between slo_low and slo_high and the run of calm windows are the hysteresis: a
fleet never scales down on one good window just after scaling up on a bad one. The
simulator calls it every window; a thin adapter would call it on Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscalerConfig:
    min_replicas: int = 1
    max_replicas: int = 1000
    window_s: float = 60.0
    slo_low: float = 0.95
    slo_high: float = 0.99
    max_queued_prefill_per_replica: int = 8192
    up_fraction: float = 0.1
    down_windows: int = 5
    deadline_safety: float = 0.5  # plan to finish batch in this share of the time left
    startup_s: float = 120.0  # a new replica serves this long after it was asked for

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        if not 0 <= self.slo_low <= self.slo_high <= 1:
            raise ValueError("need 0 <= slo_low <= slo_high <= 1")
        if not 0 < self.deadline_safety <= 1 or self.down_windows < 1 or self.window_s <= 0:
            raise ValueError("deadline_safety in (0, 1], down_windows >= 1, window_s > 0")


@dataclass(frozen=True)
class FleetWindow:
    """One window of metrics, as the gateway sees them."""

    num_replicas: int
    slo_attainment: float | None  # interactive requests finished in it meeting both targets
    queued_prefill_tokens: int  # interactive prompt tokens routed, not yet prefilled
    batch_tokens_left: int  # output tokens of batch requests not yet done
    batch_time_left_s: float  # until the earliest pending deadline
    batch_tokens_per_replica_s: float  # batch output tokens a replica made per second


@dataclass(frozen=True)
class AutoscalerState:
    calm_windows: int = 0  # windows in a row that would allow scaling down


def batch_replicas_needed(window: FleetWindow, config: AutoscalerConfig) -> int:
    """Replicas the backlog needs to be done by its deadline at the measured rate."""
    if window.batch_tokens_left <= 0:
        return 0
    rate = window.batch_tokens_per_replica_s
    time_s = window.batch_time_left_s * config.deadline_safety
    if rate <= 0 or time_s <= 0:
        return window.num_replicas  # nothing measured yet: hold
    return math.ceil(window.batch_tokens_left / (rate * time_s))


def target_replicas(
    window: FleetWindow, config: AutoscalerConfig, state: AutoscalerState
) -> tuple[int, AutoscalerState]:
    """The replica count to run next, and the state for the next window."""
    n = window.num_replicas
    attainment = 1.0 if window.slo_attainment is None else window.slo_attainment
    queued = window.queued_prefill_tokens / max(n, 1)
    pressed = attainment < config.slo_low or queued > config.max_queued_prefill_per_replica
    batch = batch_replicas_needed(window, config)
    target = max(n + max(1, math.floor(n * config.up_fraction)) if pressed else n, batch)
    calm = (
        not pressed
        and attainment >= config.slo_high
        and queued <= config.max_queued_prefill_per_replica / 4
        and batch < n
    )
    state = AutoscalerState(state.calm_windows + 1 if calm else 0)
    if target == n and state.calm_windows >= config.down_windows:
        target, state = n - 1, AutoscalerState()
    clamped = min(max(target, config.min_replicas), config.max_replicas)
    return clamped, state
