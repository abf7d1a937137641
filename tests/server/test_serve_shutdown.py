"""Stopping `tokenfleet serve` the way a terminal does (a signal to the whole process
group, engine included) ends both processes promptly and cleanly: the gateway exits with
the status its signal documents, the engine process is gone, and nothing on stderr is a
traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.live_server import children, free_port, wait_gone

pytestmark = pytest.mark.slow

# The exit status of `tokenfleet serve` after each signal, once it has shut down: uvicorn
# shuts down gracefully, then raises the signal it caught again. SIGINT's KeyboardInterrupt
# is caught by serve (as uvicorn.run does), which returns 0; SIGTERM, at its default
# action again, ends the process by the signal (Popen.returncode -SIGTERM).
EXIT_STATUS = {signal.SIGTERM: -signal.SIGTERM, signal.SIGINT: 0}

# "Promptly": a shutdown waits at most 10 s for the engine to leave before it kills it
# (EngineClient.shutdown). The bound only catches a hang, with a wide margin for a slow
# machine; a normal stop takes about a second.
SHUTDOWN_BOUND_S = 60


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
    out_path, err_path = tmp_path / "serve.out", tmp_path / "serve.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 180  # startup: converting and loading the model
        engine_pid = None
        while engine_pid is None:
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, err_path.read_text()[-3000:]
            try:
                engine_pid = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()[
                    "engine_pid"
                ]
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(0.2)
        assert engine_pid in children(proc.pid)  # the engine is the gateway's child
        os.killpg(proc.pid, sig)
        status = proc.wait(timeout=SHUTDOWN_BOUND_S)
        stderr = err_path.read_text()
        assert status == EXIT_STATUS[sig], stderr[-3000:]
        assert wait_gone(engine_pid, timeout=SHUTDOWN_BOUND_S), "the engine outlived the gateway"
        assert "Traceback" not in stderr, stderr[-3000:]
        assert f"linear layers: {linear_backend}" in out_path.read_text() + stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
