"""The event loop never waits on one request, through a real `tokenfleet serve`: a large
body is tokenized off the loop while small requests are served; half-sent connections are
closed at their read deadline and hundreds of them do not keep a normal request out; a
stream whose reader stopped reading is aborted and its KV blocks freed; /health tells
liveness from readiness."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from sqlalchemy import create_engine
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server, metric_value

from tokenfleet.batch.store import BatchStore
from tokenfleet.server.app import _store_is_up

pytestmark = pytest.mark.fake("runner")

DEADLINE_S = 2.0  # --header-timeout and --body-timeout of this module's server
STEP_S = 0.005  # each step with work takes this long: 4,000 decode steps take at least 20 s
USER = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("loop")
    args = ["--runner", "fixed", "--fixed-step-time", str(STEP_S)]
    args += ["--header-timeout", str(DEADLINE_S)]
    args += ["--body-timeout", str(DEADLINE_S), "--stream-stall-timeout", "1"]
    with live_server(tmp, *args) as s:
        yield s


def test_a_small_request_is_served_while_a_large_body_is_tokenized_fixed_runner(
    server: LiveServer,
) -> None:
    """A ~3 MB prompt takes seconds to tokenize: it is checked in the pool, and a small
    request sent meanwhile is answered before that check ends."""
    huge = "The quick brown fox jumps over the lazy dog, said Émile. " * 50_000

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=HTTP_TIMEOUT_S) as http:

            async def checking() -> float:
                reply = await http.get("/metrics")
                return metric_value(reply.text, "tokenfleet_body_checks_running")

            body = {
                "model": MODEL,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": huge}],
            }
            large = asyncio.create_task(http.post("/v1/messages", json=body))
            while await checking() == 0:  # the metrics route answers meanwhile, too
                assert not large.done(), (await large).text
            small = await http.post(
                "/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": USER}
            )
            assert small.status_code == 200, small.text
            # The small request was served before the large body's check ended.
            assert await checking() == 1
            assert not large.done()
            refused = await large
            assert refused.status_code == 400
            message = refused.json()["error"]["message"]
            assert message.startswith("prompt (") and "over the context length of 8192" in message

    asyncio.run(run())


def test_a_large_prompt_that_fits_is_served_from_the_pools_tokens_fixed_runner(
    server: LiveServer,
) -> None:
    """A body over --offload-body-bytes (16 KiB) that fits the context: the route uses the
    token ids the pool computed; they equal the small-body path's count."""
    text = "word " * 5000  # 25 KB, ~5,000 tokens
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": text}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens  # type: ignore[arg-type]
    reply = client.messages.create(model=MODEL, max_tokens=2, messages=messages)  # type: ignore[arg-type]
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == counted
    small = client.messages.count_tokens(model=MODEL, messages=USER).input_tokens  # type: ignore[arg-type]
    half = [{"role": "user", "content": "word " * 2500}]  # 12.5 KB: checked on the loop
    half_count = client.messages.count_tokens(model=MODEL, messages=half).input_tokens  # type: ignore[arg-type]
    # 2,500 more words are 2,500 more tokens here (" word" is one token), either way.
    assert counted - half_count == 2500
    assert half_count > small


def _half_sent(port: int, i: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S)
    if i % 3 == 0:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: t\r\n")  # headers never end
    elif i % 3 == 1:
        head = b"POST /v1/messages HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n"
        s.sendall(head + b'{"model": ')  # a body that stops
    else:
        pass  # nothing at all
    return s


def test_half_sent_connections_are_closed_and_do_not_keep_others_out_fixed_runner(
    server: LiveServer,
) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    held = [_half_sent(port, i) for i in range(300)]
    try:
        # While all 300 are open, a normal request is served.
        reply = httpx.post(
            server.url + "/v1/messages",
            json={"model": MODEL, "max_tokens": 1, "messages": USER},
            timeout=HTTP_TIMEOUT_S,
        )
        assert reply.status_code == 200, reply.text
        # Every one of them is closed by the server (EOF, nothing sent) at its deadline.
        started = time.monotonic()
        for s in held:
            assert s.recv(1024) == b""
        # Closed by the deadline, not by anything later (the bound catches a server that
        # never closes them: the sockets' own timeout is HTTP_TIMEOUT_S).
        assert time.monotonic() - started < HTTP_TIMEOUT_S
    finally:
        for s in held:
            s.close()
    assert httpx.get(server.url + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200


def _metrics(server: LiveServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=HTTP_TIMEOUT_S).text


def test_a_stream_whose_reader_stopped_is_aborted_and_its_blocks_freed_fixed_runner(
    server: LiveServer,
) -> None:
    """A client that reads the reply's head and then nothing: once the server's send buffer
    is full for --stream-stall-timeout, the stream is aborted (its engine requests gone,
    their KV blocks free) long before its 16 x 4,000 tokens are generated (each step takes
    STEP_S: the whole stream would take at least 20 s)."""
    text = _metrics(server)
    before = metric_value(text, "tokenfleet_streams_stalled_total")
    tokens_before = metric_value(text, "tokenfleet_generation_tokens_total")
    body = httpx.Request(
        "POST",
        "http://t/v1/chat/completions",
        json={"model": MODEL, "max_tokens": 4000, "n": 16, "stream": True, "messages": USER},
    ).content
    port = int(server.url.rsplit(":", 1)[1])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(HTTP_TIMEOUT_S)
    s.connect(("127.0.0.1", port))
    try:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        )
        s.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        assert s.recv(12) == b"HTTP/1.1 200"
        text = _metrics(server)
        deadline = time.monotonic() + 120  # only catches a stream never aborted
        while metric_value(text, "tokenfleet_streams_stalled_total") == before:
            assert time.monotonic() < deadline, "the stalled stream was not aborted"
            text = _metrics(server)
        # Aborted: nothing of it runs in the engine, its blocks are free, and it stopped
        # short of its 64,000 tokens.
        deadline = time.monotonic() + 60
        while metric_value(text, "tokenfleet_num_requests_running") or metric_value(
            text, "tokenfleet_kv_blocks_used"
        ):
            assert time.monotonic() < deadline, text
            text = _metrics(server)
        made = metric_value(text, "tokenfleet_generation_tokens_total") - tokens_before
        assert 0 < made < 64_000
        # The server closed the connection: what it had sent, then EOF.
        while chunk := s.recv(65536):
            assert len(chunk) > 0
    finally:
        s.close()


def test_health_tells_liveness_from_readiness_and_names_the_part_down_fixed_runner(
    server: LiveServer,
) -> None:
    ready = httpx.get(server.url + "/health/ready", timeout=HTTP_TIMEOUT_S)
    assert ready.status_code == 200
    pid = server.engine_pid()
    assert ready.json() == {
        "status": "ok",
        "parts": {"engine": "up", "store": "up"},
        "down": [],
        "engine_pid": pid,
    }
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120  # only catches a gateway that never notices
    while (
        ready := httpx.get(server.url + "/health/ready", timeout=HTTP_TIMEOUT_S)
    ).status_code == 200:
        assert time.monotonic() < deadline
    # Down: the engine, named; the gateway itself is alive; the store is up.
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "unavailable",
        "parts": {"engine": "down", "store": "up"},
        "down": ["engine"],
    }
    assert httpx.get(server.url + "/health/live", timeout=HTTP_TIMEOUT_S).json() == {"status": "ok"}
    server.wait_healthy()  # restarted by the gateway
    assert httpx.get(server.url + "/health/ready", timeout=HTTP_TIMEOUT_S).status_code == 200


def test_the_readiness_check_says_a_store_that_cannot_be_reached_is_down(tmp_path: Path) -> None:
    store = BatchStore(f"sqlite:///{tmp_path / 'batches.db'}")
    assert _store_is_up(store)
    store.close()
    store.engine = create_engine(f"sqlite:///{tmp_path / 'gone' / 'batches.db'}")
    assert not _store_is_up(store)
