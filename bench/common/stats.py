"""Percentiles with the semantics their benchmarks report.

`percentile` is tokenfleet.loadgen.report.percentile (q in 0..100, linear interpolation)
with NaN in place of its None, for JSON and tables; `nearest_rank` is another statistic,
kept as step_spread's results were computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenfleet.loadgen.report import percentile as _percentile


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in 0..100), linearly interpolated; NaN without values (a JSON
    and table figure, never None)."""
    value = _percentile(values, q)
    return math.nan if value is None else value


def nearest_rank(values: list[float], q: float) -> float:
    """The value at rank int(q * n) of the sorted values (q a fraction, 0..1), the largest
    at q = 1: no interpolation, so it is always one of the measured values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
