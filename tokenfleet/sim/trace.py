"""Recorded arrivals, replayed: one JSON object a line (JSONL), in time order.

    {"t": 12.5, "kind": "interactive", "prompt_tokens": 812, "output_tokens": 240,
     "prefix_id": 3, "prefix_tokens": 512}
    {"t": 600.0, "kind": "batch", "job": 7, "deadline_s": 86400, "prompt_tokens": 1500,
     "output_tokens": 300}

`prefix_id` / `prefix_tokens` (optional) name a shared system prompt and its length, as
far as the recording knows one; a batch line belongs to job `job`, due `deadline_s` after
its job's first line. Lengths are token counts; the simulator makes the token ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenfleet.sim.workload import BATCH, INTERACTIVE, Arrival

DEFAULT_DEADLINE_S = 24 * 3600.0


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the line."""


def write_trace(path: Path, arrivals: Iterable[tuple[Arrival, float | None]]) -> int:
    """Write (arrival, deadline_s for batch) pairs; returns the number of lines."""
    count = 0
    with path.open("w") as f:
        for arrival, deadline_s in arrivals:
            line: dict[str, Any] = {
                "t": arrival.arrival_s,
                "kind": arrival.kind,
                "prompt_tokens": arrival.prompt_len,
                "output_tokens": arrival.output_len,
            }
            if arrival.prefix_id >= 0:
                line["prefix_id"] = arrival.prefix_id
                line["prefix_tokens"] = arrival.prefix_len
            if arrival.kind == BATCH:
                line["job"] = arrival.job_id
                line["deadline_s"] = DEFAULT_DEADLINE_S if deadline_s is None else deadline_s
            f.write(json.dumps(line) + "\n")
            count += 1
    return count


def read_trace(path: Path) -> Iterator[tuple[Arrival, float | None]]:
    """The trace's (arrival, deadline_s) pairs, in file order (which must be time order)."""
    last = 0.0
    with path.open() as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            arrival, deadline_s = _parse(text, number, path)
            if arrival.arrival_s < last:
                raise TraceError(f"{path}:{number}: t goes backwards ({arrival.arrival_s})")
            last = arrival.arrival_s
            yield arrival, deadline_s


def _parse(text: str, number: int, path: Path) -> tuple[Arrival, float | None]:
    where = f"{path}:{number}"
    try:
        line = json.loads(text)
        kind = line["kind"]
        if kind not in (INTERACTIVE, BATCH):
            raise TraceError(f"{where}: kind must be {INTERACTIVE!r} or {BATCH!r}")
        prompt, output = int(line["prompt_tokens"]), int(line["output_tokens"])
        if prompt < 1 or output < 1:
            raise TraceError(f"{where}: prompt_tokens and output_tokens must be >= 1")
        arrival = Arrival(
            index=number,
            kind=kind,
            arrival_s=float(line["t"]),
            prompt_len=prompt,
            output_len=output,
            prefix_id=int(line.get("prefix_id", -1)),
            prefix_len=int(line.get("prefix_tokens", 0)),
            job_id=int(line.get("job", 0)) if kind == BATCH else -1,
        )
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        if isinstance(exc, TraceError):
            raise
        raise TraceError(f"{where}: {exc!r}") from exc
    deadline = float(line.get("deadline_s", DEFAULT_DEADLINE_S)) if kind == BATCH else None
    return arrival, deadline
