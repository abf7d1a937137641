"""A real `tokenfleet serve` process on 127.0.0.1, for the API tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]
    log: Path

    def engine_pid(self) -> int:
        return int(httpx.get(f"{self.url}/health", timeout=5).json()["engine_pid"])

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        """The value of an unlabelled metric line in /metrics."""
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

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


@contextmanager
def live_server(
    tmp_dir: Path, *args: str, model_folder: Path | None = None
) -> Iterator[LiveServer]:
    """Start `tokenfleet serve` with extra CLI args; stop it (SIGTERM, then SIGKILL) after."""
    port = free_port()
    log = tmp_dir / f"server-{port}.log"
    argv = [sys.executable, "-m", "tokenfleet.cli", "serve", "--port", str(port)]
    argv += ["--kv-cache-memory", str(256 << 20), "--num-threads", "1"]
    if model_folder is not None:
        argv += ["--model", str(model_folder)]
    if "--data-dir" not in args:  # a batch store of its own, unless a test shares one
        argv += ["--data-dir", str(tmp_dir / f"data-{port}")]
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv + list(args), stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
    server = LiveServer(f"http://127.0.0.1:{port}", process, log)
    try:
        server.wait_healthy()
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
