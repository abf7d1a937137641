"""A real `tokenfleet serve` process on 127.0.0.1, for the API tests."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

MODEL = "smollm2-135m-instruct"
# For the tests' own HTTP calls to a live server: long enough that only a hang fails (a
# loaded machine answers late, not never); httpx's default (5 s) is not.
HTTP_TIMEOUT_S = 60.0
GENERATED_TOKENS = "tokenfleet_generation_tokens_total"  # counted as each step's tokens arrive


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric_value(metrics: str, name: str) -> float:
    """The value of an unlabelled metric line in a /metrics text."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_until(check: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    """The first truthy value of `check()`, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f}s: {what} (last: {value!r})")
        time.sleep(every)


def process_is_gone(pid: int) -> bool:
    """Whether `pid` has exited: no such process, or a zombie no one has reaped yet (an
    orphan's parent may be a PID 1 that never reaps)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    # The state follows the command name, which is in parentheses and may hold spaces.
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> bool:
    """Poll until `pid` has exited; False if it is still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not process_is_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def children(pid: int) -> set[int]:
    """The pids of `pid`'s live child processes (Linux: /proc/PID/task/*/children)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
    return {c for c in found if not process_is_gone(c)}


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]
    log: Path

    def engine_pid(self) -> int:
        return int(httpx.get(f"{self.url}/health", timeout=HTTP_TIMEOUT_S).json()["engine_pid"])

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        """The value of an unlabelled metric line in /metrics."""
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=HTTP_TIMEOUT_S).text
        return metric_value(text, name)

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy in {timeout}s: {self.log.read_text()[-3000:]}")

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
        """Poll until `predicate()` holds; the bound only catches a hang."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout} s: {what}")
            time.sleep(0.05)

    def hang_up_once_generating(self, path: str, body: dict[str, Any]) -> float:
        """POST a long non-streamed request and close the connection once the server is
        generating its tokens (its generation counter moved): a client that gives up, at an
        event rather than after a time that must be shorter than the generation. Returns
        the counter before the request."""
        before = self.metric(GENERATED_TOKENS)

        async def give_up() -> None:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
                post = asyncio.create_task(http.post(self.url + path, json=body))
                deadline = time.monotonic() + HTTP_TIMEOUT_S
                while self.metric(GENERATED_TOKENS) == before:
                    assert not post.done(), "the request ended before the client gave up"
                    assert time.monotonic() < deadline, "no token generated"
                    await asyncio.sleep(0.02)
                assert not post.done(), "the request ended before the client gave up"
                post.cancel()  # the connection is closed with it
                with contextlib.suppress(asyncio.CancelledError):
                    await post

        asyncio.run(give_up())
        return before


@contextmanager
def live_server(
    tmp_dir: Path,
    *args: str,
    model_folder: Path | None = None,
    port: int | None = None,
    kv_cache_memory: int = 256 << 20,
) -> Iterator[LiveServer]:
    """`tokenfleet serve` with extra CLI args on 127.0.0.1 (`port`, or a free one), awaited
    until /health answers. The one way the tests start a server.

    It runs in a process group of its own (gateway and engine), so that a test may signal
    the gateway alone, the engine alone or the group. After the test: SIGTERM to the
    gateway if it still runs, then SIGKILL to whatever is left of the group (an engine a
    killed gateway left, a gateway that hung)."""
    port = free_port() if port is None else port
    log = tmp_dir / f"server-{port}-{time.monotonic_ns()}.log"
    argv = [sys.executable, "-m", "tokenfleet.cli", "serve", "--port", str(port)]
    argv += ["--kv-cache-memory", str(kv_cache_memory), "--num-threads", "1"]
    if model_folder is not None:
        argv += ["--model", str(model_folder)]
    if "--data-dir" not in args:  # a batch store of its own, unless a test shares one
        argv += ["--data-dir", str(tmp_dir / f"data-{port}")]
    if "--ttft-target" not in args:
        # Admission refuses what it predicts would start later than the target (2 s by
        # default): a loaded machine predicts slower steps. Only the admission tests,
        # which give their own target, are to see refusals.
        argv += ["--ttft-target", "3600"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv + list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
            start_new_session=True,
        )
    server = LiveServer(f"http://127.0.0.1:{port}", process, log)
    try:
        server.wait_healthy()
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def admission_retry_after(message: str, target_s: float) -> set[str]:
    """The retry-after an admission refusal may carry, from the predicted time to first
    token its message states (to 2 decimals): max(1, ceil(predicted - target))."""
    found = re.search(r"at least ([0-9.]+) s\)", message)
    assert found is not None, message
    predicted = float(found.group(1))
    return {str(max(1, math.ceil(p - target_s))) for p in (predicted - 0.005, predicted + 0.005)}
