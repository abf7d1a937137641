"""A progress line with the wall-clock time, flushed at once."""

from __future__ import annotations

import time


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
