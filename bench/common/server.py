"""Servers on 127.0.0.1 for the benchmarks: a free port, a `tokenfleet serve` or a peer
(bench/peers/serve-peer) started, awaited until it answers, and stopped.

Three ways, as the benchmarks measure:

* started / tokenfleet_server / peer_server: a context manager; the server in its own
  process group, ready when a path answers 200, stopped whole (SIGTERM, then SIGKILL).
* start_gateway / stop_gateway: async; ready when /health answers, which gives the engine
  process's pid; the gateway alone is signalled.
* serving / wait_healthy: the server in its own process group, SIGTERM to the group when
  done; /health's answer returned (its engine_pid).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
            if httpx.get(server.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
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


def tokenfleet_server(
    args: argparse.Namespace,
    tmp: Path,
    name: str,
    policy: str,
    targets: tuple[float, float] | None,
    extra: Sequence[str] = (),
) -> Any:
    port = free_port()
    argv = [sys.executable, "-m", "tokenfleet.cli", "serve", "--port", str(port)]
    argv += ["--scheduling-policy", policy, "--num-threads", str(args.num_threads)]
    argv += ["--max-model-len", str(args.max_model_len)]
    argv += ["--data-dir", tempfile.mkdtemp(prefix=f"{name}-data-", dir=tmp)]
    if targets is None:  # calibration: nothing refused
        argv += ["--ttft-target", "3600"]
    else:
        argv += ["--ttft-target", f"{targets[0]:.4f}", "--tpot-target", f"{targets[1]:.4f}"]
    argv += list(extra)
    url = f"http://127.0.0.1:{port}"
    return started(name, argv, url, "/health", tmp / f"{name}.log", None, 300)


def peer_server(args: argparse.Namespace, tmp: Path, name: str) -> Any:
    port = free_port()
    env = {
        "THREADS": str(args.num_threads),
        "CTX_PER_SLOT": str(args.max_model_len),
        "LOG_DIR": str(tmp),
    }
    argv = [str(SERVE_PEER), name, str(port)]
    url = f"http://127.0.0.1:{port}"
    return started(name, argv, url, "/v1/models", tmp / f"serve-peer-{name}.log", env, 960)


# -- a gateway awaited in an event loop, with its engine's pid -------------------------------


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    engine_pid: int = 0


async def start_gateway(argv_tail: list[str], log_dir: Path, timeout_s: float = 300) -> Gateway:
    port = free_port()
    log = log_dir / "serve.log"
    argv = [sys.executable, "-m", "tokenfleet.cli", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--data-dir", str(log_dir / "data"), *argv_tail]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    gateway = Gateway(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=gateway.url, timeout=5) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"tokenfleet serve exited: {log.read_text()[-3000:]}")
            try:
                response = await http.get("/health")
                if response.status_code == 200:
                    gateway.engine_pid = int(response.json()["engine_pid"])
                    return gateway
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    stop_gateway(gateway)
    raise TimeoutError(f"tokenfleet serve not healthy in {timeout_s}s: {log.read_text()[-3000:]}")


def stop_gateway(gateway: Gateway) -> None:
    if gateway.process.poll() is None:
        gateway.process.send_signal(signal.SIGTERM)
        try:
            gateway.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            gateway.process.kill()
            gateway.process.wait()


# -- a server whose group gets SIGTERM when done; /health's answer -------------------------


@contextmanager
def serving(
    argv: list[str], log: Path, stop_timeout_s: float = 60
) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` started in its own process group, its output into `log`; SIGTERM to the group
    on the way out, then up to stop_timeout_s for it to exit."""
    with log.open("wb") as out:
        server = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield server
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=stop_timeout_s)


def wait_healthy(
    server: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 300
) -> httpx.Response:
    """Polls `url`/health until it answers 200 (returned); RuntimeError if the server exits
    or timeout_s passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")
        try:
            health = httpx.get(f"{url}/health", timeout=2)
            if health.status_code == 200:
                return health
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
