"""Servers on 127.0.0.1 for the benchmarks: a free port, a `tokenfleet serve` or a peer
(bench/peers/serve-peer) started, awaited until it answers, and stopped.

One way for every benchmark: `started` runs the server in its own process group, waits
until a path answers 200 (its JSON kept as `Server.ready`: /health gives the engine's
pid), and stops the group whole (SIGTERM, then SIGKILL). `tokenfleet_serve` and
`peer_server` build the command lines; `tokenfleet_server` is the serving benchmarks'
command line (policy, targets, threads) on top of `tokenfleet_serve`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.log import log

SERVE_PEER = Path(__file__).resolve().parent.parent / "peers" / "serve-peer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- servers: each in its own process group, stopped whole ----------------------------------


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    ready: dict[str, Any] = field(default_factory=dict)  # the ready path's JSON answer


def stop_group(process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """SIGTERM to the process's group, SIGKILL to what is left after timeout_s."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            process.poll()  # reap the leader: a zombie still counts as one of the group
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def wait_ready(server: Server, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() not in (None, 0):  # serve-peer exits 0 once its peer answers
            raise RuntimeError(f"{server.name} did not start: {server.log.read_text()[-3000:]}")
        try:
            answer = httpx.get(server.url + path, timeout=2)
        except httpx.HTTPError:
            answer = None
        if answer is not None and answer.status_code == 200:
            is_json = answer.headers.get("content-type", "").startswith("application/json")
            server.ready = answer.json() if is_json else {}
            return
        time.sleep(0.2)
    raise TimeoutError(
        f"{server.name} not ready in {timeout_s} s: {server.log.read_text()[-3000:]}"
    )


@contextmanager
def started(
    name: str,
    argv: list[str],
    url: str,
    ready_path: str,
    log_path: Path,
    env: dict[str, str] | None,
    timeout_s: float,
) -> Iterator[Server]:
    with log_path.open("wb") as sink:
        process = subprocess.Popen(
            argv,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # the server and all it starts share this group
            env=None if env is None else os.environ | env,
        )
    server = Server(name, url, process, log_path)
    try:
        log(f"starting {name} ({url}) ...")
        t0 = time.monotonic()
        wait_ready(server, ready_path, timeout_s)
        log(f"{name} ready in {time.monotonic() - t0:.0f} s")
        yield server
    finally:
        stop_group(process)
        process.wait()


def tokenfleet_serve(
    name: str,
    tmp: Path,
    flags: Sequence[str],
    timeout_s: float = 300,
    env: dict[str, str] | None = None,
) -> AbstractContextManager[Server]:
    """`tokenfleet serve` on a free port of 127.0.0.1 with `flags` and its own data folder
    under `tmp`, ready when /health answers (`Server.ready["engine_pid"]`); `env`: variables
    set beside this process's own (RAY_TMPDIR for a fleet's local Ray instance)."""
    port = free_port()
    argv = [sys.executable, "-m", "tokenfleet.cli", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--data-dir", tempfile.mkdtemp(prefix=f"{name}-data-", dir=tmp)]
    argv += list(flags)
    url = f"http://127.0.0.1:{port}"
    return started(name, argv, url, "/health", tmp / f"{name}.log", env, timeout_s)


def tokenfleet_server(
    args: argparse.Namespace,
    tmp: Path,
    name: str,
    policy: str,
    targets: tuple[float, float] | None,
    extra: Sequence[str] = (),
) -> AbstractContextManager[Server]:
    flags = ["--scheduling-policy", policy, "--num-threads", str(args.num_threads)]
    flags += ["--max-model-len", str(args.max_model_len)]
    if targets is None:  # calibration: nothing refused
        flags += ["--ttft-target", "3600"]
    else:
        flags += ["--ttft-target", f"{targets[0]:.4f}", "--tpot-target", f"{targets[1]:.4f}"]
    return tokenfleet_serve(name, tmp, [*flags, *extra])


def peer_server(args: argparse.Namespace, tmp: Path, name: str) -> AbstractContextManager[Server]:
    port = free_port()
    env = {
        "THREADS": str(args.num_threads),
        "CTX_PER_SLOT": str(args.max_model_len),
        "LOG_DIR": str(tmp),
    }
    argv = [str(SERVE_PEER), name, str(port)]
    url = f"http://127.0.0.1:{port}"
    return started(name, argv, url, "/v1/models", tmp / f"serve-peer-{name}.log", env, 960)
