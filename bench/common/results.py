"""A benchmark's result: the machine it ran on, how busy the CPUs were, its tables, and
its `name`.json and `name`.png written into the output folder."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from common.log import log

BUSY_WARNING = 0.1  # warn when other processes keep this share of the CPUs busy


# -- the machine -------------------------------------------------------------------------


def machine_info(threads: int) -> dict[str, Any]:
    cpu_model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                cpu_model,
            )
    except OSError:
        pass

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu_model": cpu_model,
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "torch_num_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "tokenfleet": version("tokenfleet"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def cpu_busy_fraction(interval_s: float = 1.0) -> float | None:
    """Share of all CPUs busy over the next interval, from /proc/stat (None if unreadable).

    Run before the benchmark starts, it shows other processes competing for the cores.
    """

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return 1 - (idle1 - idle0) / total if total > 0 else None


@dataclass(frozen=True)
class RunStart:
    """When a run started and how busy the CPUs were just before: its result's first fields."""

    started_at: datetime
    cpu_busy: float | None

    @classmethod
    def now(cls) -> RunStart:
        started_at = datetime.now(UTC)
        busy = cpu_busy_fraction()
        if busy is not None and busy > BUSY_WARNING:
            log(f"warning: the CPUs are already {busy:.0%} busy; the figures will be noisy")
        return cls(started_at, busy)

    def provenance(self, args: argparse.Namespace) -> dict[str, Any]:
        """What reproduces the run and what it ran on."""
        return {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": self.started_at.isoformat(timespec="seconds"),
            "machine": machine_info(args.num_threads) | {"cpu_busy_at_start": self.cpu_busy},
        }


# -- writing a result --------------------------------------------------------------------


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments as JSON takes them (paths as strings, in lists too)."""

    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return {k: plain(v) for k, v in vars(args).items()}


def run_and_write(
    args: argparse.Namespace,
    name: str,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    plot: Callable[[Path, dict[str, Any]], None],
) -> dict[str, Any]:
    """`run(args)`, dated when it starts, then its result written (write_results)."""
    date = datetime.now(UTC).isoformat(timespec="seconds")
    result = run(args)
    write_results(args, name, date, result, lambda path: plot(path, result))
    return result


def write_results(
    args: argparse.Namespace,
    name: str,
    date: str,
    result: dict[str, Any],
    plot: Callable[[Path], None],
) -> None:
    """`name`.json (the command, date, machine, arguments and `result`) and `name`.png (by
    `plot`) into `args.out`; `args.num_threads` is the machine's thread setting."""
    out = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": date,
        "machine": machine_info(args.num_threads),
        "args": args_json(args),
        **result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / f"{name}.json", args.out / f"{name}.png"
    json_path.write_text(json.dumps(out, indent=1) + "\n")
    plot(png_path)
    print(f"wrote {json_path} and {png_path}")


def write_result(
    out: Path, name: str, result: dict[str, Any], plot: Callable[[Path], None]
) -> None:
    """`name`.json (the result) and `name`.png (what `plot` draws there) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    plot(png_path)
    log(f"wrote {json_path} and {png_path}")


# -- tables ------------------------------------------------------------------------------


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_ms(value: float | None) -> str:
    """Seconds as whole milliseconds for a table cell; "-" for none."""
    return "-" if value is None else f"{value * 1000:.0f}"
