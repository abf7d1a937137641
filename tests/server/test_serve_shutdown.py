"""Stopping `tokenfleet serve` the way a terminal does (a signal to the whole process
group, engine included) ends both processes promptly and cleanly: the gateway exits with
the status its signal documents, the engine process is gone, and nothing in the server's
output is a traceback."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from support.live_server import children, live_server, wait_gone

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
    backend = ("--linear-backend", linear_backend)
    with live_server(tmp_path, *backend, model_folder=model_folder, kv_cache_memory=32 << 20) as s:
        engine_pid = s.engine_pid()
        assert engine_pid in children(s.process.pid)  # the engine is the gateway's child
        os.killpg(s.process.pid, sig)
        status = s.process.wait(timeout=SHUTDOWN_BOUND_S)
        log = s.log.read_text()
        assert status == EXIT_STATUS[sig], log[-3000:]
        assert wait_gone(engine_pid, timeout=SHUTDOWN_BOUND_S), "the engine outlived the gateway"
        assert "Traceback" not in log, log[-3000:]
        assert f"linear layers: {linear_backend}" in log
