"""`tokenfleet serve --replicas N` without `--ray-address`: the gateway starts a Ray
instance of its own on this machine, places the replicas on it, and takes it all down when
it stops. The fixed runner (every token " a") stands in for the model."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from support.live_server import HTTP_TIMEOUT_S, MODEL, live_server, wait_gone
from support.ray_cluster import descendants, is_loopback, listening_sockets, wait_fleet_ready

pytestmark = pytest.mark.fake("runner")

NUM_REPLICAS = 2
MAX_TOKENS = 30


def test_replicas_without_a_ray_address_run_on_a_local_ray_on_loopback_gone_at_exit(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas on a local Ray instance the gateway started: both ready on one node,
    in processes of their own below the gateway; every listening socket of the gateway,
    Ray and the replicas on 127.0.0.1; a stream and a non-streamed answer exact; after
    SIGTERM the gateway shuts down and every process it started (Ray's, the replicas) is
    gone, without a SIGKILL."""
    # The gateway's Ray files, here: a short path (Ray's socket paths must fit 107 bytes).
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path_factory.mktemp("ray")))
    args = ["--runner", "fixed", "--fixed-step-time", "0.01", "--replicas", str(NUM_REPLICAS)]
    with live_server(tmp_path, *args) as server:
        rows = wait_fleet_ready(server, NUM_REPLICAS)
        gateway = server.process.pid
        below = descendants(gateway)
        assert {r["pid"] for r in rows} <= below and len({r["pid"] for r in rows}) == 2
        assert len({r["node"] for r in rows}) == 1
        sockets = listening_sockets(below | {gateway})
        assert {str(a) for a, _ in sockets.values() if not is_loopback(a)} == set()
        ports = {port for _, port in sockets.values()}
        assert int(server.url.rsplit(":", 1)[1]) in ports
        assert {int(r["address"].rsplit(":", 1)[1]) for r in rows} <= ports

        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
        )
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == " a" * MAX_TOKENS
        answer = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
        )
        assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (
            " a" * MAX_TOKENS,
            "length",
        )

        below = descendants(gateway)
        os.kill(gateway, signal.SIGTERM)
        # A graceful stop: the lifespan's shutdown ran, then SIGTERM at its default action
        # again ends the process (as tests/server/test_serve_shutdown.py has it).
        assert server.process.wait(60) == -signal.SIGTERM
        assert "Application shutdown complete." in server.log.read_text()
        left = sorted(pid for pid in below if not wait_gone(pid, 30))
        assert left == [], f"left after the gateway stopped: {left}"
