"""Canary streams stay exact while hostile requests of every class are sent beside them
(issue 29's interference test; docs/reliability.md), over a real `tokenfleet serve` with the
bundled model and API keys in groups.

Two greedy canary streams, one through each official client, are run first on the idle
server and then again with every hostile class sent beside them: each class is sent once
both canaries have begun streaming (all classes at once, a thread each), and its outcome is
seen before either canary ends. The canaries' text and tokens equal what they were on the
idle server, and each hostile class gets its own outcome, never a 5xx:

- (a) fields out of range (top_k, temperature, seeds past 64 bits, token ids past the
  vocabulary, n, nesting): 400 in the API's format naming the field; a temperature too
  small for float32 logits (1e-300) is served, not a 500;
- (b) a small body asking for many engine requests (prompts x n): 400;
- (c) a 3 MB body: refused after being tokenized off the event loop, while both canaries
  keep receiving tokens;
- (d) half-sent connections (headers that never end, a body that stops, nothing): closed
  by the server at its header and body deadlines, with nothing sent;
- (e) a stream whose reader never reads: aborted once the send buffer stays full, short of
  its end;
- (f) API-key headers of non-ASCII bytes, or a key no one has: 401 in the API's format;
- (g) one key group flooding: its requests over its requests per minute are 429s with
  retry-after, while the canaries' group is served;
- (h) batches with a poison line: the OpenAI batch fails naming the line, the Message
  Batch is a 400 naming the request; a batch with a formerly poisonous value runs.

Afterwards the engine is the one the server started with, and nothing runs or holds a KV
block."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from support.api import (
    USER,
    assert_anthropic_400,
    assert_openai_400,
    chat,
    cmpl,
    nested,
    post_json,
    raw_exchange,
)
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server, metric_value

pytestmark = pytest.mark.slow

OPERATOR = {"x-api-key": "operator-key-1"}
CANARY_KEYS = ("canary-anthropic", "canary-openai")
# The canaries share a group; every hostile class has a key (and so a group) of its own.
KEYS = "\n".join(
    [f"{key} canary" for key in CANARY_KEYS]
    + ["bounds-1", "amplify-1", "big-1", "slow-1", "flood-1", "batch-1"]
)
REQUESTS_PER_MINUTE = 20  # each group's; the flood sends FLOOD requests at once
FLOOD = 40
DEADLINE_S = 2.0  # --header-timeout and --body-timeout
CANARY_TOKENS = 128  # neither canary prompt ends by itself before this (asserted on idle)
STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]
POEM = [{"role": "user", "content": "Write a long poem about the sea."}]
CHAT, CMPL, MSGS = "/v1/chat/completions", "/v1/completions", "/v1/messages"
BIG_INT = 2**63 - 1024  # the largest int field value the server takes


@pytest.fixture(scope="module")
def server(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("interference")
    (tmp / "keys.txt").write_text(KEYS + "\n")
    args = ["--api-keys-file", str(tmp / "keys.txt"), "--operator-key", OPERATOR["x-api-key"]]
    args += ["--requests-per-minute-per-group", str(REQUESTS_PER_MINUTE)]
    args += ["--header-timeout", str(DEADLINE_S), "--body-timeout", str(DEADLINE_S)]
    args += ["--stream-stall-timeout", "1", "--ttft-target", "3600"]
    # The default TPOT target is the reference GPU's (60 ms). On a 2-core CPU the decode
    # steps of the canaries beside the unread stream's 16 are past it, so each new prompt
    # would get one token a step (harvest.with_floor) and the served hostile requests (the
    # flood's 20, then out_of_range's) could end only after the canaries: the test would
    # time that policy here, not the interference. 0.5 s a step is past any step here.
    args += ["--tpot-target", "0.5"]
    with live_server(tmp, *args, model_folder=model_folder) as s:
        yield s


def gauge(server: LiveServer, name: str) -> float:
    return server.metric(name, OPERATOR)


# -- the canaries ---------------------------------------------------------------------------


@dataclass
class Canary:
    text: str
    tokens: list[str]  # the OpenAI canary's tokens (from its logprobs); [] for Anthropic's
    logprobs: list[float]
    output_tokens: int
    finish: str
    times: list[float] = field(default_factory=list)  # when each text delta arrived


async def anthropic_canary(url: str, begun: asyncio.Event) -> Canary:
    client = anthropic.AsyncAnthropic(base_url=url, api_key=CANARY_KEYS[0], max_retries=0)
    parts, times = [], []
    try:
        async with client.messages.stream(
            model=MODEL,
            max_tokens=CANARY_TOKENS,
            messages=STORY,  # type: ignore[arg-type]
            extra_body={"temperature": 0},
        ) as stream:
            async for text in stream.text_stream:
                times.append(time.monotonic())
                parts.append(text)
                begun.set()
            message = await stream.get_final_message()
    finally:
        begun.set()  # a canary that fails releases the wait on it (and gather raises)
    usage = message.usage.output_tokens
    return Canary("".join(parts), [], [], usage, str(message.stop_reason), times)


async def openai_canary(url: str, begun: asyncio.Event) -> Canary:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=CANARY_KEYS[1], max_retries=0)
    parts, times, tokens, logprobs = [], [], [], []
    finish, usage = "", -1
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=POEM,  # type: ignore[arg-type]
            max_tokens=CANARY_TOKENS,
            temperature=0,
            logprobs=True,
            top_logprobs=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.delta.content:
                times.append(time.monotonic())
                parts.append(choice.delta.content)
                begun.set()
            for entry in (choice.logprobs.content if choice.logprobs else None) or []:
                tokens.append(entry.token)
                logprobs.append(entry.logprob)
            finish = choice.finish_reason or finish
    finally:
        begun.set()
    return Canary("".join(parts), tokens, logprobs, usage, finish, times)


async def canaries_with(server: LiveServer, hostile: list[Callable[[LiveServer], Seen]]) -> Run:
    """Both canaries; once both are streaming, each hostile class in a thread of its own."""
    begun = [asyncio.Event(), asyncio.Event()]
    streams = [
        asyncio.create_task(anthropic_canary(server.url, begun[0])),
        asyncio.create_task(openai_canary(server.url, begun[1])),
    ]
    await asyncio.gather(*(event.wait() for event in begun))
    loop = asyncio.get_running_loop()
    # A thread each (asyncio's default pool has 6 on 2 cores: the last classes would wait).
    with ThreadPoolExecutor(max_workers=max(1, len(hostile))) as pool:
        threads = [loop.run_in_executor(pool, send, server) for send in hostile]
        found = await asyncio.gather(*streams, *threads)
    return Run(found[:2], found[2:])


@dataclass
class Seen:
    """One hostile class: when it was sent and when its outcome was seen (the unread
    stream: its abort; the large body: its check running)."""

    name: str
    sent: float
    seen: float
    during: tuple[float, float] | None = None  # a span in which the canaries must progress
    batch_id: str | None = None  # the Message Batch that runs (checked once it ends)


@dataclass
class Run:
    canaries: list[Canary]
    hostile: list[Seen]


# -- the hostile classes -------------------------------------------------------------------


def post(server: LiveServer, path: str, key: str, body: Any) -> httpx.Response:
    return post_json(server, path, body, {"x-api-key": key})


OPENAI_OUT_OF_RANGE = [
    (CHAT, chat(top_k=2**64), "top_k"),
    (CHAT, chat(top_k=-2), "top_k"),
    (CHAT, chat(temperature=2.5), "temperature"),
    (CHAT, chat(seed=2**64), "seed"),
    (CHAT, chat(seed=BIG_INT, n=2), "seed"),  # seed + 1 past int64
    (CHAT, chat(logit_bias={"1000000": 1}), "logit_bias"),  # past the vocabulary
    (CHAT, chat(logit_bias={"99999999999999999999999": 1}), "logit_bias"),
    (CHAT, chat(stop_token_ids=[2**70]), "stop_token_ids.0"),
    (CMPL, cmpl(prompt=[1_000_000]), "prompt"),
    (CHAT, chat(max_tokens=10**6), "max_tokens"),  # over the context
]
ANTHROPIC_OUT_OF_RANGE = [
    (chat(top_k=2**64), "top_k"),
    (chat(top_k=-1), "top_k"),
    (chat(temperature=1.5), "temperature"),
    (chat(metadata=nested(40)), "JSON nested"),
]


def out_of_range(server: LiveServer) -> Seen:
    """(a) 400s naming the field; a temperature of 1e-300 (0 in float32) is served."""
    sent = time.monotonic()
    for path, body, param in OPENAI_OUT_OF_RANGE:
        assert_openai_400(post(server, path, "bounds-1", body), param)
    for body, name in ANTHROPIC_OUT_OF_RANGE:
        assert_anthropic_400(post(server, MSGS, "bounds-1", body), name)
    for path in (CHAT, MSGS):
        served = post(server, path, "bounds-1", chat(temperature=1e-300, max_tokens=2))
        assert served.status_code == 200, served.text
    return Seen("out_of_range", sent, time.monotonic())


def amplification(server: LiveServer) -> Seen:
    """(b) A body of a few hundred bytes asking for more engine requests than one request
    may make (64): 400 before anything reaches the engine."""
    sent = time.monotonic()
    bodies = [
        (CMPL, cmpl(prompt=["a"] * 20, n=4), "prompt", 80),
        (CMPL, cmpl(prompt=[[1, 2]] * 64, n=16), "prompt", 1024),
        (CHAT, chat(n=17), "n", None),  # past n's own bound (16)
    ]
    for path, body, param, count in bodies:
        assert len(json.dumps(body)) < 1000
        error = assert_openai_400(post(server, path, "amplify-1", body), param)
        if count is not None:
            assert f"asks for {count} generations" in error["message"], error
    return Seen("amplification", sent, time.monotonic())


def large_body(server: LiveServer) -> Seen:
    """(c) A 3 MB prompt: tokenized in the pool (the gateway's metrics answer meanwhile,
    and the canaries' tokens keep arriving: checked on `during`), then refused as over
    the context."""
    huge = "The quick brown fox jumps over the lazy dog, said Émile. " * 50_000
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": huge}]}

    async def run() -> Seen:
        async with httpx.AsyncClient(base_url=server.url, timeout=HTTP_TIMEOUT_S) as http:
            sent = time.monotonic()
            large = asyncio.create_task(http.post(MSGS, json=body, headers={"x-api-key": "big-1"}))
            checking: list[float] = []
            while not large.done():
                metrics = await http.get("/metrics", headers=OPERATOR)
                if metric_value(metrics.text, "tokenfleet_body_checks_running") == 1:
                    checking.append(time.monotonic())
                await asyncio.sleep(0.05)
            refused = await large
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert message.startswith("prompt (") and "over the context length of" in message
        assert checking, "the body's check was never seen running"
        return Seen("large_body", sent, checking[0], (checking[0], checking[-1]))

    return asyncio.run(run())


def half_sent(server: LiveServer) -> Seen:
    """(d) 60 connections that send part of their headers, part of their body, or nothing:
    each is closed by the server (EOF, nothing sent) at its deadline."""
    port = int(server.url.rsplit(":", 1)[1])
    sent = time.monotonic()
    held = []
    for i in range(60):
        s = socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S)
        if i % 3 == 0:
            s.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: t\r\nx-api-key: big-1\r\n")
        elif i % 3 == 1:
            head = b"POST /v1/messages HTTP/1.1\r\nhost: t\r\nx-api-key: big-1\r\n"
            s.sendall(head + b"content-length: 100\r\n\r\n" + b'{"model": ')
        held.append(s)
    try:
        for s in held:
            assert s.recv(1024) == b""
    finally:
        for s in held:
            s.close()
    return Seen("half_sent", sent, time.monotonic())


def slow_reader(server: LiveServer) -> Seen:
    """(e) A stream of 16 choices with 20 top logprobs a token (~30 KB a step), read up to
    its status and then never: once the send buffer stays full past --stream-stall-timeout
    it is aborted, and what was sent ends without [DONE]. The client's MSS is Ethernet's:
    on loopback's 64 KiB MSS the kernel grows the send buffer to 4 MiB (minutes here)."""
    body = json.dumps(
        chat(max_tokens=2000, n=16, stream=True, logprobs=True, top_logprobs=20, messages=STORY)
    ).encode()
    port = int(server.url.rsplit(":", 1)[1])
    stalled = gauge(server, "tokenfleet_streams_stalled_total")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1460)
    s.settimeout(HTTP_TIMEOUT_S)
    try:
        s.connect(("127.0.0.1", port))
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nx-api-key: slow-1\r\n"
        head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        sent = time.monotonic()
        s.sendall(head + body)
        assert s.recv(12) == b"HTTP/1.1 200"
        deadline = time.monotonic() + 240  # only catches a stream never aborted
        while gauge(server, "tokenfleet_streams_stalled_total") == stalled:
            assert time.monotonic() < deadline, "the unread stream was not aborted"
            time.sleep(0.1)
        seen = time.monotonic()
        got = b""
        while chunk := s.recv(65536):  # what the server had sent, then EOF
            got += chunk
    finally:
        s.close()
    assert b'"index":15' in got  # all 16 choices had begun
    assert b"data: [DONE]" not in got and b'"finish_reason":"length"' not in got
    return Seen("slow_reader", sent, seen)


ANTHROPIC_401 = b'"type":"error","error":{"type":"authentication_error"'
OPENAI_401 = b'"type":"invalid_request_error","param":null,"code":"invalid_api_key"'


def bad_auth(server: LiveServer) -> Seen:
    """(f) Key headers of bytes no key has: 401 in each API's format."""
    sent = time.monotonic()
    for header in (
        b"x-api-key: \xc3\xa9t\xc3\xa9\r\n",
        b"x-api-key: \xff\xfe\x80\r\n",
        b"authorization: Bearer \xe9\xff\r\n",
        b"x-api-key: canary-anthropic\xe9\r\n",  # a key and then some
    ):
        for path, expected in ((MSGS, ANTHROPIC_401), (CHAT, OPENAI_401)):
            status, reply = _raw(server, path, header, json.dumps(chat()).encode())
            assert (status, expected in reply) == (401, True), reply
    claude = anthropic.Anthropic(base_url=server.url, api_key="nosuch", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        claude.messages.create(model=MODEL, max_tokens=1, messages=USER)  # type: ignore[arg-type]
    gpt = openai.OpenAI(base_url=server.url + "/v1", api_key="nosuch", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        gpt.chat.completions.create(model=MODEL, max_tokens=1, messages=USER)  # type: ignore[arg-type]
    assert refused.value.code == "invalid_api_key"
    return Seen("bad_auth", sent, time.monotonic())


def _raw(server: LiveServer, path: str, headers: bytes, body: bytes) -> tuple[int, bytes]:
    """A POST of raw header bytes; the reply's status and body."""
    request = b"POST " + path.encode() + b" HTTP/1.1\r\nhost: t\r\n" + headers
    request += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    return raw_exchange(server, request + body)


def flood(server: LiveServer) -> Seen:
    """(g) FLOOD requests at once from one group: its requests per minute are served (and
    what refilled meanwhile, one a 3 s), the rest are 429s with retry-after in each API's
    format."""

    async def run() -> tuple[float, float, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=HTTP_TIMEOUT_S) as http:
            sent = time.monotonic()
            replies = await asyncio.gather(
                *(
                    http.post(
                        MSGS if i % 2 else CHAT, json=chat(), headers={"x-api-key": "flood-1"}
                    )
                    for i in range(FLOOD)
                )
            )
            return sent, time.monotonic(), list(replies)

    sent, done, replies = asyncio.run(run())
    served = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(served) + len(refused) == FLOOD, [r.status_code for r in replies]
    refill = (done - sent) * REQUESTS_PER_MINUTE / 60
    assert REQUESTS_PER_MINUTE <= len(served) <= REQUESTS_PER_MINUTE + refill + 1
    for reply in refused:
        assert reply.headers["retry-after"] in ("1", "2", "3")  # one request refills in 3 s
        if reply.request.url.path == MSGS:
            assert reply.json()["error"]["type"] == "rate_limit_error"
            assert reply.headers["anthropic-ratelimit-requests-remaining"] == "0"
        else:
            error = reply.json()["error"]
            assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
            assert reply.headers["x-ratelimit-remaining-requests"] == "0"
    return Seen("flood", sent, done)


def poison_batches(server: LiveServer) -> Seen:
    """(h) Batches with a poison line: refused naming it. A Message Batch with a value that
    used to fail in the engine (temperature 1e-300) is created and runs (checked after)."""
    sent = time.monotonic()
    good = {"custom_id": "ok", "method": "POST", "url": CHAT, "body": chat(temperature=0)}
    for poison, (line, param) in (
        (b'{"custom_id": "poison", "method": "POST", "url"', (2, None)),
        (
            json.dumps({**good, "custom_id": "bad", "body": chat(top_k=2**64)}).encode(),
            (2, "body.top_k"),
        ),
    ):
        data = json.dumps(good).encode() + b"\n" + poison + b"\n"
        upload = httpx.post(
            server.url + "/v1/files",
            files={"file": ("in.jsonl", data)},
            data={"purpose": "batch"},
            headers={"x-api-key": "batch-1"},
            timeout=HTTP_TIMEOUT_S,
        )
        assert upload.status_code == 200, upload.text
        create = {
            "input_file_id": upload.json()["id"],
            "endpoint": CHAT,
            "completion_window": "24h",
        }
        batch = post(server, "/v1/batches", "batch-1", create)
        assert batch.status_code == 200, batch.text
        assert batch.json()["status"] == "failed", batch.text
        error = batch.json()["errors"]["data"][0]
        assert (error["line"], error["param"]) == (line, param), error
    requests = [
        {"custom_id": "ok", "params": chat(temperature=0)},
        {"custom_id": "bad", "params": chat(top_k=-1)},
    ]
    refused = post(server, "/v1/messages/batches", "batch-1", {"requests": requests})
    assert_anthropic_400(refused, "requests[1].params.top_k")
    requests[1] = {"custom_id": "tiny", "params": chat(temperature=1e-300, max_tokens=2)}
    created = post(server, "/v1/messages/batches", "batch-1", {"requests": requests})
    assert created.status_code == 200, created.text
    return Seen("poison_batches", sent, time.monotonic(), batch_id=created.json()["id"])


HOSTILE = [
    out_of_range,
    amplification,
    large_body,
    half_sent,
    slow_reader,
    bad_auth,
    flood,
    poison_batches,
]


# -- the test -------------------------------------------------------------------------------


def test_canary_streams_stay_exact_while_every_hostile_class_is_sent_beside_them(
    server: LiveServer,
) -> None:
    engine = server.engine_pid()
    idle = asyncio.run(canaries_with(server, [])).canaries
    # The canaries run to max_tokens: long enough to stream beside everything below.
    assert [c.finish for c in idle] == ["max_tokens", "length"]
    assert [c.output_tokens for c in idle] == [CANARY_TOKENS] * 2
    assert len(idle[1].tokens) == CANARY_TOKENS

    run = asyncio.run(canaries_with(server, HOSTILE))

    # The canaries' tokens are exactly the idle server's.
    for canary, alone in zip(run.canaries, idle, strict=True):
        assert (canary.text, canary.output_tokens, canary.finish) == (
            alone.text,
            alone.output_tokens,
            alone.finish,
        )
    assert run.canaries[1].tokens == idle[1].tokens
    assert run.canaries[1].logprobs == pytest.approx(idle[1].logprobs, abs=1e-4)
    # Every class was sent while both canaries streamed, and had its outcome (or, for the
    # unread stream, its abort) before either ended.
    began = max(c.times[0] for c in run.canaries)
    ended = min(c.times[-1] for c in run.canaries)
    assert [h.name for h in run.hostile] == [send.__name__ for send in HOSTILE]
    for hostile in run.hostile:
        assert began < hostile.sent and hostile.seen < ended, hostile
        if hostile.during is not None:  # the large body: both canaries went on meanwhile
            start, end = hostile.during
            for canary in run.canaries:
                assert any(start <= t <= end for t in canary.times), (hostile, canary.times)

    # The Message Batch with the formerly poisonous line ran: both requests succeeded.
    batch_id = run.hostile[-1].batch_id
    key = {"x-api-key": "batch-1"}

    def ended_batch() -> bool:
        batch = httpx.get(f"{server.url}/v1/messages/batches/{batch_id}", headers=key).json()
        return bool(batch["processing_status"] == "ended")

    server.wait_until(ended_batch, "the batch ended")
    results = httpx.get(f"{server.url}/v1/messages/batches/{batch_id}/results", headers=key)
    lines = [json.loads(line) for line in results.text.splitlines()]
    assert sorted((r["custom_id"], r["result"]["type"]) for r in lines) == [
        ("ok", "succeeded"),
        ("tiny", "succeeded"),
    ]
    # Nothing took the engine down; nothing runs or holds a block once all is done.
    assert server.engine_pid() == engine
    server.wait_until(
        lambda: (
            gauge(server, "tokenfleet_num_requests_running") == 0
            and gauge(server, "tokenfleet_kv_blocks_used") == 0
        ),
        "nothing running, no KV block held",
    )
