"""A replica's health as one gateway judges it, beyond alive or dead: slow (its steps run
above the fleet's by a set factor: no new work) and what a silent replica becomes
(the FleetClient acts; this decides and counts).

Slow, per replica, one *window* per beat (every 0.2 s; the replica's mean interval between
busy steps since its previous beat, ReplicaBeat.step_ms_window):

    average   exponential moving average of its windows (ALPHA per window); a window
              without a step leaves it as it was
    median    of the *other* replicas' averages: one replica alone is never slow, one of
              two is judged against the other, a slow one cannot raise its own bar

             average > factor x median, and so were its last SLOW_AFTER_WINDOWS windows
      ready ───────────────────────────▶ slow      no new work; what runs on it stays
        ▲    average <= recover x median   │
        ├──────────────────────────────────┤       (recover < factor: no flapping)
        └──────────────────────────────────┘
             PROBE_WINDOWS windows in a row without a step while slow (no work, so
             nothing to measure): back on probation, its average forgotten; measured
             slow again, it is slow again

Slow is a replica that *runs* slow: its last SLOW_AFTER_WINDOWS windows (2 s) each over
the bar, not only its average. A stall of a second or so (the machine busy for a moment,
a neighbour loading its model on a shared host) moves the average past it, but is not a
slow replica. With the usual factor 2, a replica slowed 3x is slow at its
SLOW_AFTER_WINDOWS-th window of the new pace (its average, ALPHA 0.4, is over the bar
from the 2nd: 3 - 2 x 0.6^k > 2; still so if a fixed overhead per step makes the
measured ratio only 2.6); a partial first window makes it at most SLOW_WITHIN_WINDOWS,
the bound the tests state.

Silent, by the time since a replica last spoke (the watchdog's): past the replica timeout
its requests move (as on a death: the attempt fencing drops what it sends of them later)
and it gets no new work, but if it speaks again it serves again; past the fence timeout
it is fenced: its incarnation is never taken from again, and Ray is asked to replace it
(Ray never notices a frozen actor).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

ALPHA = 0.4  # the weight of a window in the moving average
PROBE_WINDOWS = 25  # 5 s at the 0.2 s beat
SLOW_AFTER_WINDOWS = 10  # windows in a row over the bar: 2 s at the 0.2 s beat
# A replica slowed 3x (factor 2) is slow within this many of its windows (see above).
SLOW_WITHIN_WINDOWS = SLOW_AFTER_WINDOWS + 2


@dataclass(frozen=True)
class SlowRule:
    """`factor`: slow when the average runs above `factor` x the median (None or 0: the
    rule is off); `recover`: ready again at or under `recover` x the median (None: midway
    between 1 and `factor`)."""

    factor: float | None = 2.0
    recover: float | None = None

    def __post_init__(self) -> None:
        if self.factor is not None and self.factor != 0 and self.factor <= 1:
            raise ValueError(
                f"the slow replica factor must be over 1 (or 0: off), got {self.factor}"
            )
        if self.recover is not None and self.on and not 1 <= self.recover < self.slow_above:
            raise ValueError(
                f"the recovery factor must be from 1 to under {self.slow_above}, got {self.recover}"
            )

    @property
    def on(self) -> bool:
        return bool(self.factor)

    @property
    def slow_above(self) -> float:
        return self.factor or 0.0

    @property
    def ready_at(self) -> float:
        return self.recover if self.recover is not None else (1 + self.slow_above) / 2


@dataclass
class StepAverage:
    """One replica's step time as the rule sees it."""

    average_ms: float | None = None
    num_over: int = 0  # its latest windows in a row over the bar
    num_windows: int = 0  # windows that moved the average, since it was last forgotten
    idle_windows: int = 0  # windows in a row without a step, while slow
    slow: bool = False
    slow_at_window: int | None = None  # num_windows when it last became slow
    median_ms: float | None = None  # the other replicas' median at its latest window


@dataclass
class FleetHealth:
    """The slow rule over a gateway's replicas, and the counts /metrics shows."""

    rule: SlowRule = field(default_factory=SlowRule)
    replicas: dict[int, StepAverage] = field(default_factory=dict)
    num_dropped: int = 0  # messages dropped: a fenced incarnation's, a moved attempt's outputs
    num_fenced: int = 0  # replicas fenced since the gateway started
    num_became_slow: int = 0

    @property
    def num_slow(self) -> int:
        return sum(r.slow for r in self.replicas.values())

    def is_slow(self, replica_id: int) -> bool:
        found = self.replicas.get(replica_id)
        return found is not None and found.slow

    def forget(self, replica_id: int) -> None:
        """The replica is dead, fenced, gone or a new incarnation: measured anew."""
        self.replicas.pop(replica_id, None)

    def median_of_others(self, replica_id: int) -> float | None:
        others = [
            r.average_ms
            for i, r in self.replicas.items()
            if i != replica_id and r.average_ms is not None
        ]
        return statistics.median(others) if others else None

    def window(self, replica_id: int, step_ms: float | None) -> bool | None:
        """One window of the replica (a beat): its mean step time then, None without a
        step. Returns True when it became slow, False when it stopped being slow, None
        when that did not change."""
        one = self.replicas.setdefault(replica_id, StepAverage())
        was = one.slow
        if step_ms is None:
            if one.slow:
                one.idle_windows += 1
                if one.idle_windows >= PROBE_WINDOWS:  # probation: measured anew
                    self.replicas[replica_id] = StepAverage()
            return self._changed(was, self.replicas[replica_id].slow)
        one.idle_windows = 0
        if one.average_ms is None:
            one.average_ms = step_ms
        else:
            one.average_ms += ALPHA * (step_ms - one.average_ms)
        one.num_windows += 1
        median = one.median_ms = self.median_of_others(replica_id)
        rule = self.rule
        if not rule.on or median is None:
            one.slow, one.num_over = False, 0
            return self._changed(was, one.slow)
        one.num_over = one.num_over + 1 if step_ms > rule.slow_above * median else 0
        over = one.average_ms > rule.slow_above * median
        if not one.slow and over and one.num_over >= SLOW_AFTER_WINDOWS:
            one.slow, one.slow_at_window = True, one.num_windows
            self.num_became_slow += 1
        elif one.slow and one.average_ms <= rule.ready_at * median:
            one.slow = False
        return self._changed(was, one.slow)

    @staticmethod
    def _changed(was: bool, now: bool) -> bool | None:
        return None if was == now else now

    def describe(self, replica_id: int) -> dict[str, object]:
        """The replica's part of its GET /admin/fleet row."""
        one = self.replicas.get(replica_id) or StepAverage()
        return {
            "step_ms_avg": _ms(one.average_ms),
            "step_ms_median": _ms(one.median_ms),
            "step_windows": one.num_windows,
            "slow_at_window": one.slow_at_window,
        }

    def describe_fleet(self) -> dict[str, object]:
        rule = self.rule
        return {
            "slow_replica_factor": rule.factor if rule.on else None,
            "slow_recover_factor": rule.ready_at if rule.on else None,
            "slow_replicas": self.num_slow,
            "slow_episodes": self.num_became_slow,
            "fenced": self.num_fenced,
            "dropped_messages": self.num_dropped,
        }


def _ms(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None
