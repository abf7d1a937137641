"""A fleet for the fleet benchmarks: `tokenfleet serve --replicas N` (bench/common/server.py
starts it) on a local Ray instance of its own, awaited until every replica is ready.

The gateway answers /health once one replica is ready; a benchmark wants all N, so this
waits on GET /admin/fleet. Ray's files go to a short folder of their own (RAY_TMPDIR: its
socket paths must stay under the 107 bytes a Unix socket path may have), removed after.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from common.log import log
from common.server import Server, tokenfleet_serve


def fleet_state(url: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """GET /admin/fleet's replicas, by id."""
    answer = httpx.get(url + "/admin/fleet", headers=headers, timeout=10)
    answer.raise_for_status()
    return sorted(answer.json()["replicas"], key=lambda r: r["id"])


def wait_replicas_ready(
    url: str,
    num_replicas: int,
    timeout_s: float,
    headers: dict[str, str] | None = None,
    restarts: int = 0,
) -> list[dict[str, Any]]:
    """Poll /admin/fleet until `num_replicas` replicas are ready with at least `restarts`
    restarts in all; the replicas then."""
    deadline = time.monotonic() + timeout_s
    shown = -1
    while True:
        replicas = fleet_state(url, headers)
        ready = sum(r["state"] == "ready" for r in replicas)
        if ready >= num_replicas and sum(r["restarts"] for r in replicas) >= restarts:
            return replicas
        if ready != shown:
            log(f"{ready}/{num_replicas} replicas ready")
            shown = ready
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ready}/{num_replicas} replicas ready after {timeout_s} s")
        time.sleep(0.5)


@contextmanager
def fleet_serve(
    name: str,
    tmp: Path,
    flags: Sequence[str],
    num_replicas: int,
    timeout_s: float = 600,
    headers: dict[str, str] | None = None,
) -> Iterator[Server]:
    """`tokenfleet serve --replicas num_replicas` with `flags`, yielded once every replica
    is ready (`timeout_s` for the whole start)."""
    ray_tmp = tempfile.mkdtemp(prefix="tfray-")
    t0 = time.monotonic()
    try:
        serve = tokenfleet_serve(
            name,
            tmp,
            ["--replicas", str(num_replicas), *flags],
            timeout_s,
            env={"RAY_TMPDIR": ray_tmp},
        )
        with serve as server:
            left = max(1.0, timeout_s - (time.monotonic() - t0))
            wait_replicas_ready(server.url, num_replicas, left, headers)
            log(f"{name}: {num_replicas} replicas ready in {time.monotonic() - t0:.0f} s")
            yield server
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def session_rss_mib(sid: int) -> float:
    """Resident memory of every process in the session `sid` (a server started by
    `started`, and all it started: Ray's processes and the replicas), MiB, from /proc;
    shared pages are counted in each process."""
    total_kib = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:  # state ppid pgrp session ...
                continue
            with open(f"/proc/{entry.name}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total_kib += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total_kib / 1024
