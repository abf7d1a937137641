"""The autoscaler: a pure function from one window of fleet metrics to a replica count
(`target_replicas`), and the object that keeps its state between windows (`Autoscaler`),
which the simulator and the live fleet both call once a window.

    up    interactive latency at risk: SLO attainment < slo_low ("slo"), or queued
          interactive prefill per ready replica > max_queued_prefill_per_replica
          ("queue"): +max(1, up_fraction x ready), but not while replicas asked for
          are still starting ("starting": the signal was measured without them)
    up    batch would miss its deadline at the current size ("deadline"): to the count
          the backlog needs at the batch rate measured per replica, finishing within
          deadline_safety of the time left; a rate not measured (BatchRateMeter: the
          replicas not fed with batch work, or not settled) holds the count instead
    down  by one ("calm"), after down_windows windows in a row in which both are safe:
          attainment >= slo_high, prefill queues under a quarter of their limit, the
          backlog needing fewer replicas than run now, none starting
    else  "hold"; a change the cool-down forbids is held ("cooldown"); one outside
          [min_replicas, max_replicas] is held at the bound ("limit")

Counts: `num_replicas` is every replica asked for (ready and starting), so a replica
still starting counts as there and is never asked for twice. Cool-downs run from the
previous change, up or down, to the second:

    change at t        t + up_cooldown_s             t + down_cooldown_s
    ────┼──── no up ───────────┼──── up allowed ─────────────┼──── down allowed too

The slo_low..slo_high band and the calm run are the hysteresis: a fleet never scales down
on one good window just after scaling up on a bad one. The bounds come first: a fleet
outside them is moved inside at once, whatever the cool-downs.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

_FAR_TOO_MANY = 2**31  # what a backlog needs when its rate is next to nothing

Reason = Literal["slo", "queue", "deadline", "calm", "cooldown", "starting", "limit", "hold"]


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
    up_cooldown_s: float = 60.0  # no scale-up sooner than this after the previous change
    down_cooldown_s: float = 300.0  # no scale-down sooner than this after it
    # The batch rate is measured only this long after batch work began waiting for the
    # replicas, or their number changed: an engine's first fill of batch prefills, or a
    # replica just up, reads well under the rate it keeps (BatchRateMeter).
    batch_settle_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        if not 0 <= self.slo_low <= self.slo_high <= 1:
            raise ValueError("need 0 <= slo_low <= slo_high <= 1")
        if not 0 < self.deadline_safety <= 1 or self.down_windows < 1 or self.window_s <= 0:
            raise ValueError("deadline_safety in (0, 1], down_windows >= 1, window_s > 0")
        if min(self.up_cooldown_s, self.down_cooldown_s, self.up_fraction, self.batch_settle_s) < 0:
            raise ValueError(
                "up_cooldown_s, down_cooldown_s, up_fraction and batch_settle_s must be >= 0"
            )


@dataclass(frozen=True)
class FleetWindow:
    """One window of metrics, as the gateway sees them."""

    now_s: float  # when the window closed, on the caller's clock
    num_replicas: int  # asked for: ready and starting
    num_starting: int  # asked for, not ready yet
    slo_attainment: float | None  # interactive requests finished in it meeting both targets
    queued_prefill_tokens: int  # interactive prompt tokens routed, not yet prefilled
    batch_tokens_left: int  # output tokens of batch requests not yet done
    batch_time_left_s: float  # until the earliest pending deadline
    batch_tokens_per_replica_s: float  # made per ready replica per second (0: not measured)

    def __post_init__(self) -> None:
        if not 0 <= self.num_starting <= self.num_replicas:
            raise ValueError("need 0 <= num_starting <= num_replicas")

    @property
    def num_ready(self) -> int:
        return self.num_replicas - self.num_starting


@dataclass(frozen=True)
class AutoscalerState:
    calm_windows: int = 0  # windows in a row that would allow scaling down
    last_change_s: float | None = None  # when the target last differed from the count


@dataclass(frozen=True)
class ScaleDecision:
    """One window's decision, for the history: the count it saw, the target, and why."""

    now_s: float
    num_replicas: int
    num_starting: int
    target: int
    reason: Reason


class BatchRateMeter:
    """The batch output tokens a ready replica makes per second, as `FleetWindow` wants it,
    from the tokens generated in each window (counted as they are made, not when their
    request ends). A window is measured only when its whole span saw the replicas fed:
    batch requests waiting for a replica (queued, not leased) at both of its ends, the
    ready replicas the same at both, and that since `batch_settle_s` before it began.
    Otherwise 0, which the policy reads as "not measured": it holds. So neither a job's
    first windows (nothing, then engines filling with prefills), nor a job's tail (every
    request already on a replica: more replicas cannot make it sooner), nor a replica just
    up reads as a slow fleet that needs `max_replicas`."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self.fed_since: float | None = None  # when queued work and this ready count began
        self.ready = -1

    def rate(self, start_s: float, now_s: float, tokens: int, queued: int, ready: int) -> float:
        """The rate over the window [start_s, now_s], in which `tokens` were generated; it
        ends with `queued` batch requests waiting and `ready` replicas ready."""
        measured = (
            self.fed_since is not None
            and queued > 0
            and ready == self.ready
            and self.fed_since + self.settle_s <= start_s
            and now_s > start_s
        )
        return tokens / max(ready, 1) / (now_s - start_s) if measured else 0.0

    def close(self, start_s: float, now_s: float, tokens: int, queued: int, ready: int) -> float:
        """`rate`, and the window `closed`."""
        rate = self.rate(start_s, now_s, tokens, queued, ready)
        self.closed(now_s, queued, ready)
        return rate

    def closed(self, now_s: float, queued: int, ready: int) -> None:
        """The window ends at `now_s` as `rate` was told: the next one starts there."""
        if queued <= 0:
            self.fed_since = None
        elif self.fed_since is None or ready != self.ready:
            self.fed_since = now_s
        self.ready = ready


def batch_replicas_needed(window: FleetWindow, config: AutoscalerConfig) -> int:
    """Replicas the backlog needs to be done by its deadline at the measured rate."""
    if window.batch_tokens_left <= 0:
        return 0
    rate = window.batch_tokens_per_replica_s
    time_s = window.batch_time_left_s * config.deadline_safety
    per_replica = rate * time_s  # tokens one replica makes in the time planned
    if rate <= 0 or time_s <= 0 or per_replica <= 0:
        return window.num_replicas  # nothing measured yet (or no time left): hold
    needed = window.batch_tokens_left / per_replica
    return math.ceil(needed) if needed < _FAR_TOO_MANY else _FAR_TOO_MANY


def target_replicas(
    window: FleetWindow, config: AutoscalerConfig, state: AutoscalerState
) -> tuple[ScaleDecision, AutoscalerState]:
    """The replica count to run next and why, and the state for the next window."""
    n, ready = window.num_replicas, window.num_ready
    attainment = 1.0 if window.slo_attainment is None else window.slo_attainment
    queued = window.queued_prefill_tokens / max(ready, 1)
    slo = attainment < config.slo_low
    queue = queued > config.max_queued_prefill_per_replica
    batch = batch_replicas_needed(window, config)
    calm = (
        not slo
        and attainment >= config.slo_high
        and queued <= config.max_queued_prefill_per_replica / 4
        and batch < n
        and window.num_starting == 0
    )
    calm_windows = state.calm_windows + 1 if calm else 0

    reason: Reason
    want, reason = n, "hold"
    if slo or queue:
        if window.num_starting:
            reason = "starting"
        else:
            want = ready + max(1, math.floor(ready * config.up_fraction))
            reason = "slo" if slo else "queue"
    if batch > want:
        want, reason = batch, "deadline"
    if want == n and calm_windows >= config.down_windows and n > config.min_replicas:
        want, reason = n - 1, "calm"

    target = min(max(want, config.min_replicas), config.max_replicas)
    if not config.min_replicas <= n <= config.max_replicas:
        if target == min(max(n, config.min_replicas), config.max_replicas):
            reason = "limit"  # moved inside the bounds, cool-downs or not
    elif target == n and want != n:
        reason = "limit"
    elif target != n and _cooling(window.now_s, target > n, config, state):
        target, reason = n, "cooldown"

    decision = ScaleDecision(window.now_s, n, window.num_starting, target, reason)
    if target == n:
        return decision, AutoscalerState(calm_windows, state.last_change_s)
    return decision, AutoscalerState(0, window.now_s)


def _cooling(now_s: float, up: bool, config: AutoscalerConfig, state: AutoscalerState) -> bool:
    if state.last_change_s is None:
        return False
    cooldown_s = config.up_cooldown_s if up else config.down_cooldown_s
    return now_s - state.last_change_s < cooldown_s


class Autoscaler:
    """The policy and its state across windows: one object per autoscaled pool, the same
    in the simulator and on the live fleet. The caller starts or drains replicas to reach
    `decide`'s count and reports the replicas it has asked for in the next window."""

    def __init__(self, config: AutoscalerConfig, *, max_history: int = 100_000) -> None:
        self.config = config
        self.state = AutoscalerState()
        self.history: deque[ScaleDecision] = deque(maxlen=max_history)

    def decide(self, window: FleetWindow) -> int:
        """The target replica count for this window; the decision joins `history`."""
        if self.history and window.now_s < self.history[-1].now_s:
            raise ValueError(
                f"window at {window.now_s} s is before the last one ({self.history[-1].now_s} s)"
            )
        decision, self.state = target_replicas(window, self.config, self.state)
        self.history.append(decision)
        if decision.target != decision.num_replicas:
            logger.info(
                "autoscaler: %d -> %d replicas (%s)",
                decision.num_replicas,
                decision.target,
                decision.reason,
            )
        return decision.target


def parse_autoscale(text: str) -> tuple[int, int]:
    """`--autoscale MIN:MAX` as (min_replicas, max_replicas), e.g. "2:8" -> (2, 8)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"--autoscale wants MIN:MAX (e.g. 2:8), got {text!r}")
    try:
        low, high = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(
            f"--autoscale wants two whole numbers MIN:MAX (e.g. 2:8), got {text!r}"
        ) from None
    if low < 1:
        raise ValueError(f"--autoscale MIN must be at least 1, got {low}")
    if high < low:
        raise ValueError(f"--autoscale MAX must be at least MIN, got {text!r}")
    return low, high
