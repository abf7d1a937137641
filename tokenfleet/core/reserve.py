"""The KV blocks held back from batch work for interactive arrivals, sized from demand.

The scheduler reports how many blocks interactive requests hold after every step; the
reserve is the peak of those reports over the last `window_s` seconds times `margin`,
clamped to [min_blocks, max_fraction * num_blocks]. Batch requests are admitted and
grown only while at least that many blocks stay free, so an interactive burst like a
recent one finds room without waiting for a preemption; when interactive traffic stops,
the reserve falls back to min_blocks one window later. Time is passed in.
"""

from __future__ import annotations

import math
from collections import deque

from tokenfleet.config import check_reserve_settings


class InteractiveReserve:
    def __init__(
        self,
        num_blocks: int,
        *,
        window_s: float,
        margin: float,
        min_blocks: int = 0,
        max_fraction: float,
    ) -> None:
        check_reserve_settings(
            window_s=window_s, margin=margin, min_blocks=min_blocks, max_fraction=max_fraction
        )
        self.window_s = window_s
        self.margin = margin
        self.min_blocks = min_blocks
        self.max_blocks = math.floor(max_fraction * num_blocks)
        # (time, blocks) with blocks strictly decreasing front to back: the front is the
        # peak of the window, and a report is dropped once a later one is as high.
        self._reports: deque[tuple[float, int]] = deque()

    def observe(self, now: float, interactive_blocks_in_use: int) -> None:
        """Record what interactive requests hold at `now` (times never go backwards)."""
        while self._reports and self._reports[-1][1] <= interactive_blocks_in_use:
            self._reports.pop()
        self._reports.append((now, interactive_blocks_in_use))

    def peak(self, now: float) -> int:
        """The most blocks interactive requests held in (now - window_s, now]."""
        while self._reports and self._reports[0][0] <= now - self.window_s:
            self._reports.popleft()
        return self._reports[0][1] if self._reports else 0

    def blocks(self, now: float) -> int:
        # Rounded before the ceiling so that 10 * 1.2 is 12 blocks, not 13.
        wanted = math.ceil(round(self.peak(now) * self.margin, 6))
        return min(max(wanted, self.min_blocks), self.max_blocks)
