"""Timing a callable."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(f: Callable[[], Any], repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
