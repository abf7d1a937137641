"""Stopping `tokenfleet serve` the way a terminal does (a signal to the whole process
group, engine included) ends both processes promptly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.live_server import free_port

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("sig", "linear_backend"), [(signal.SIGTERM, "torch"), (signal.SIGINT, "onednn")]
)
def test_signal_to_the_process_group_stops_gateway_and_engine(
    tmp_path: Path, model_folder: Path, sig: signal.Signals, linear_backend: str
) -> None:
    """(Each run also forces one --linear-backend, which the engine process logs.)"""
    port = free_port()
    argv = [sys.executable, "-m", "tokenfleet.cli", "serve", "--port", str(port)]
    argv += ["--model", str(model_folder), "--kv-cache-memory", str(32 << 20)]
    argv += ["--linear-backend", linear_backend]
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        engine_pid = None
        while time.monotonic() < deadline and engine_pid is None:
            try:
                engine_pid = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()[
                    "engine_pid"
                ]
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(0.2)
        assert engine_pid is not None, (tmp_path / "serve.log").read_text()[-2000:]
        os.killpg(proc.pid, sig)
        assert proc.wait(timeout=15) is not None
        time.sleep(0.5)
        with pytest.raises(ProcessLookupError):
            os.kill(engine_pid, 0)
        assert f"linear layers: {linear_backend}" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
