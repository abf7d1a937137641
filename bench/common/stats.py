"""Percentiles with the semantics their benchmarks report.

tokenfleet.loadgen.report.percentile (q in 0..100, linear interpolation, None without
values) is the one for request latencies; these two differ from it and are kept as the
benchmarks' results were computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in 0..100) by numpy's linear interpolation; NaN without
    values (a JSON and table figure, never None)."""
    return float(np.percentile(values, q)) if values else math.nan


def nearest_rank(values: list[float], q: float) -> float:
    """The value at rank int(q * n) of the sorted values (q a fraction, 0..1), the largest
    at q = 1: no interpolation, so it is always one of the measured values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
