"""Keys, key groups and each group's limits, through a real `tokenfleet serve`: blank keys
refused at start-up, any header bytes a 401 (never a 500), the operator key for /metrics,
per-group concurrency and tokens per minute (429 with retry-after and the rate-limit
headers each API's clients read), and the prefix cache isolated per group."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from support.api import raw_exchange
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, free_port, live_server

from tokenfleet.cli.main import main
from tokenfleet.server.limits import GroupLimits, RateLimited, RateLimiter, go_duration

pytestmark = pytest.mark.fake("runner")

OPERATOR = "operator-key-1"
# Two keys of group alpha, one of beta, and one alone (its own group).
KEYS = "# comment\nalpha-1 alpha\nalpha-2 alpha\nbeta-1 beta\nsolo-1\n"
TPM = 30_000
USER: list[Any] = [{"role": "user", "content": "Say hello."}]
ANTHROPIC_HEADERS = [
    f"{kind}-{part}" for kind in ("requests", "tokens") for part in ("limit", "remaining", "reset")
]
OPENAI_HEADERS = [
    f"{part}-{kind}" for kind in ("requests", "tokens") for part in ("limit", "remaining", "reset")
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("keys")
    keys = tmp / "keys.txt"
    keys.write_text(KEYS)
    args = ["--runner", "fixed", "--api-keys-file", str(keys), "--operator-key", OPERATOR]
    args += ["--max-concurrent-requests-per-group", "2", "--tokens-per-minute-per-group"]
    args += [str(TPM)]
    with live_server(tmp, *args) as s:
        yield s


def _refused(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "tokenfleet.cli", "serve", "--port", str(free_port())]
    argv += ["--data-dir", str(tmp / "data"), *args]
    # The timeout only catches a server that serves instead of refusing.
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp)


@pytest.mark.parametrize(
    ("args", "keys_file", "message"),
    [
        (["--api-key", ""], None, "--api-key: an API key may not be empty or whitespace"),
        (["--api-key", "  "], None, "--api-key: an API key may not be empty or whitespace"),
        ([], "good-1\n\ngood-2\n", "keys.txt:2: blank line (an empty API key is not accepted)"),
        (["--api-key", "caller", "--operator-key", "caller"], None, "--operator-key must differ"),
        (["--api-key", "caf\u00e9"], None, "must be printable ASCII"),
    ],
)
def test_blank_or_unsendable_keys_are_refused_at_start_up(
    tmp_path: Path, args: list[str], keys_file: str | None, message: str
) -> None:
    if keys_file is not None:
        (tmp_path / "keys.txt").write_text(keys_file)
        args = [*args, "--api-keys-file", str(tmp_path / "keys.txt")]
    done = _refused(tmp_path, *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Uvicorn running" not in done.stderr  # refused before anything started


def _post(path: str, headers: bytes, body: bytes = b"{}") -> bytes:
    return (
        b"POST "
        + path.encode()
        + b" HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        + headers
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


ANTHROPIC_401 = b'"type":"error","error":{"type":"authentication_error"'
OPENAI_401 = b'"type":"invalid_request_error","param":null,"code":"invalid_api_key"'


@pytest.mark.parametrize(
    "header",
    [
        b"x-api-key: \xc3\xa9t\xc3\xa9\r\n",  # UTF-8
        b"x-api-key: \xff\xfe\x80\r\n",  # not UTF-8 at all
        b"authorization: Bearer \xe9\xff\r\n",
        b"authorization: \xff\r\n",
        b"x-api-key: " + b"k" * 40_000 + b"\r\n",  # huge, within the header bound
        b"x-api-key: alpha-1\xe9\r\n",  # a key and then some
        b"x-api-key: \r\n",
        b"",
    ],
)
def test_any_header_bytes_give_a_401_in_the_apis_format_fixed_runner(
    server: LiveServer, header: bytes
) -> None:
    status, body = raw_exchange(server, _post("/v1/messages", header))
    assert (status, ANTHROPIC_401 in body) == (401, True), body
    status, body = raw_exchange(server, _post("/v1/chat/completions", header))
    assert (status, OPENAI_401 in body) == (401, True), body


def test_header_bytes_http_forbids_are_a_4xx_in_the_apis_format_fixed_runner(
    server: LiveServer,
) -> None:
    # A control character: the HTTP parser refuses the request before any route; still
    # the API's JSON error (400), never a 500 or a bare text reply.
    status, body = raw_exchange(server, _post("/v1/messages", b"x-api-key: a\x01b\r\n"))
    assert status == 400
    assert body.startswith(b'{"type": "error", "error": {"type": "invalid_request_error"')
    status, body = raw_exchange(server, _post("/v1/chat/completions", b"x-api-key: a\x00b\r\n"))
    assert status == 400
    assert body.startswith(b'{"error": {"message": "malformed HTTP request')
    # Headers over --max-header-bytes (64 KiB): 431.
    status, body = raw_exchange(
        server, _post("/v1/messages", b"x-api-key: " + b"k" * 70_000 + b"\r\n")
    )
    assert status == 431
    assert b"request line and headers are over 65536 bytes" in body
    assert httpx.get(server.url + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200


def test_metrics_need_the_operator_key_and_caller_keys_do_not_open_it_fixed_runner(
    server: LiveServer,
) -> None:
    metrics = server.url + "/metrics"
    for headers in ({}, {"x-api-key": "alpha-1"}, {"authorization": "Bearer beta-1"}):
        reply = httpx.get(metrics, headers=headers, timeout=HTTP_TIMEOUT_S)
        assert reply.status_code == 401
        assert reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(metrics, headers={"x-api-key": OPERATOR}).status_code == 200
    bearer = {"authorization": f"Bearer {OPERATOR}"}
    assert "tokenfleet_rate_limited" in httpx.get(metrics, headers=bearer).text
    # The operator key is no caller's key.
    client = anthropic.Anthropic(base_url=server.url, api_key=OPERATOR, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model=MODEL, max_tokens=1, messages=USER)
    # Health probes are open.
    for path in ("/health", "/health/live", "/health/ready"):
        assert httpx.get(server.url + path, timeout=HTTP_TIMEOUT_S).status_code == 200


def test_scaling_needs_the_operator_key_and_a_fleet_fixed_runner(
    server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """POST /admin/fleet/scale: 401 without the operator key (a caller's key included);
    with it, a bad body is a 400 naming `replicas`, and a good one a 400 saying a single
    engine process cannot scale; `tokenfleet fleet` says the same and lists the engine."""
    scale = server.url + "/admin/fleet/scale"
    for headers in ({}, {"x-api-key": "alpha-1"}):
        reply = httpx.post(scale, json={"replicas": 2}, headers=headers, timeout=HTTP_TIMEOUT_S)
        assert reply.status_code == 401, reply.text
    operator = {"x-api-key": OPERATOR}
    for body in ({"replicas": 0}, {"replicas": "2"}, {"replicas": 2.5}, {"replicas": True}, {}):
        reply = httpx.post(scale, json=body, headers=operator, timeout=HTTP_TIMEOUT_S)
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["error"]["param"] == "replicas", (body, reply.text)
    reply = httpx.post(scale, content=b"{", headers=operator, timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 400 and "malformed JSON" in reply.json()["error"]["message"]
    reply = httpx.post(scale, json={"replicas": 2}, headers=operator, timeout=HTTP_TIMEOUT_S)
    needs = "scaling needs a fleet of replicas (serve --replicas or --ray-address)"
    assert (reply.status_code, reply.json()["error"]["message"]) == (400, needs)
    assert main(["fleet", "scale", "2", "--url", server.url]) == 1
    assert "tokenfleet fleet scale: 401: missing or invalid operator key" in capsys.readouterr().err
    assert main(["fleet", "scale", "2", "--url", server.url, "--operator-key", OPERATOR]) == 1
    assert f"tokenfleet fleet scale: 400: {needs}" in capsys.readouterr().err
    assert main(["fleet", "status", "--url", server.url, "--operator-key", OPERATOR]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["0", "ready"]


def _stream(server: LiveServer, key: str) -> tuple[socket.socket, bytes]:
    """A long stream, opened and left unread once its reply has started (it holds one of
    its group's places until the socket is closed)."""
    body = httpx.Request(
        "POST",
        "http://t/v1/messages",
        json={"model": MODEL, "max_tokens": 8000, "messages": USER, "stream": True},
    ).content
    port = int(server.url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(_post("/v1/messages", b"x-api-key: " + key.encode() + b"\r\n", body))
    head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    return s, head


def test_a_groups_concurrency_limit_is_its_own_fixed_runner(server: LiveServer) -> None:
    first, _ = _stream(server, "alpha-1")
    second, _ = _stream(server, "alpha-2")  # the same group, another key
    try:
        # Both of alpha's places are taken: a third request of alpha is refused at once...
        claude = anthropic.Anthropic(base_url=server.url, api_key="alpha-1", max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as refused:
            claude.messages.create(model=MODEL, max_tokens=1, messages=USER)
        assert refused.value.status_code == 429
        assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
        assert "its limit is 2 at once" in refused.value.message
        headers = refused.value.response.headers
        assert headers["retry-after"] == "1"
        assert headers["anthropic-ratelimit-requests-limit"] == "1200"
        assert headers["anthropic-ratelimit-tokens-limit"] == str(TPM)
        gpt = openai.OpenAI(base_url=server.url + "/v1", api_key="alpha-2", max_retries=0)
        with pytest.raises(openai.RateLimitError) as refused_openai:
            gpt.chat.completions.create(model=MODEL, max_tokens=1, messages=USER)
        error = refused_openai.value.body
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"  # type: ignore[index]
        assert refused_openai.value.response.headers["x-ratelimit-limit-requests"] == "1200"
        # ... while beta and the key alone are served.
        beta = anthropic.Anthropic(base_url=server.url, api_key="beta-1", max_retries=0)
        assert beta.messages.create(model=MODEL, max_tokens=1, messages=USER).usage.output_tokens
        solo = openai.OpenAI(base_url=server.url + "/v1", api_key="solo-1", max_retries=0)
        reply = solo.chat.completions.create(model=MODEL, max_tokens=1, messages=USER)
        assert reply.choices[0].finish_reason == "length"
    finally:
        first.close()
    # A place of alpha is free once a stream's caller has gone (its abort frees it).
    deadline_reached = _until_served(server, "alpha-1")
    assert deadline_reached == 200
    second.close()


def _until_served(server: LiveServer, key: str) -> int:
    """Retry at 429 (the freed place is released as the server sees the disconnect); the
    bound only catches a place never given back."""
    body = {"model": MODEL, "max_tokens": 1, "messages": USER}
    for _ in range(600):
        reply = httpx.post(
            server.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=60
        )
        if reply.status_code != 429:
            return reply.status_code
    return 429


def test_tokens_per_minute_charge_prompt_plus_max_tokens_fixed_runner(
    server: LiveServer,
) -> None:
    # The key alone is its own group: nothing else charged it. Each call: its prompt plus
    # max_tokens, charged when it starts; a stop string ends it at its first token.
    gpt = openai.OpenAI(base_url=server.url + "/v1", api_key="solo-1", max_retries=0)
    count = anthropic.Anthropic(base_url=server.url, api_key="solo-1").messages.count_tokens
    prompt = count(model=MODEL, messages=USER).input_tokens
    charged = 0
    max_tokens = 8000 - prompt  # 8,000 tokens charged a call: 3 fit in 30,000, not 4
    for _ in range(3):
        raw = gpt.chat.completions.with_raw_response.create(
            model=MODEL,
            max_tokens=max_tokens,
            messages=USER,
            stop=["a"],
        )
        charged += prompt + max_tokens
        headers = raw.headers
        assert headers["x-ratelimit-limit-tokens"] == str(TPM)
        remaining = int(headers["x-ratelimit-remaining-tokens"])
        # What is left: the limit less the charges, plus the refill (TPM/60 a second).
        assert TPM - charged <= remaining < TPM - charged + 1000
        assert re.fullmatch(r"(\d+m)?\d+(\.\d+)?s|\d+ms", headers["x-ratelimit-reset-tokens"])
    with pytest.raises(openai.RateLimitError) as refused:
        gpt.chat.completions.create(
            model=MODEL,
            max_tokens=max_tokens,
            messages=USER,
            stop=["a"],
        )
    error = refused.value.body
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "tokens"  # type: ignore[index]
    assert f"needs {prompt + max_tokens} tokens" in error["message"]  # type: ignore[index]
    assert int(refused.value.response.headers["retry-after"]) >= 1
    # The same group through the Anthropic API, in its header names and its error type.
    claude = anthropic.Anthropic(base_url=server.url, api_key="solo-1", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as limited:
        claude.messages.create(model=MODEL, max_tokens=max_tokens, messages=USER)
    headers = limited.value.response.headers
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    for name in ANTHROPIC_HEADERS:
        assert f"anthropic-ratelimit-{name}" in headers
    reset = datetime.strptime(headers["anthropic-ratelimit-tokens-reset"], "%Y-%m-%dT%H:%M:%SZ")
    assert reset.replace(tzinfo=UTC) > datetime.now(UTC)
    # Another group is not charged for it.
    beta = openai.OpenAI(base_url=server.url + "/v1", api_key="beta-1", max_retries=0)
    raw = beta.chat.completions.with_raw_response.create(
        model=MODEL,
        max_tokens=max_tokens,
        messages=USER,
        stop=["a"],
    )
    for name in OPENAI_HEADERS:
        assert f"x-ratelimit-{name}" in raw.headers


def _hit_tokens(server: LiveServer) -> float:
    return float(server.metric("tokenfleet_prefix_cache_hit_tokens_total", {"x-api-key": OPERATOR}))


def test_the_prefix_cache_is_isolated_per_key_group_fixed_runner(server: LiveServer) -> None:
    # A prompt of many blocks, new to this server from its first block (its own system
    # prompt); each request's blocks stay cached.
    long = [{"role": "user", "content": "isolation " * 300}]
    body = {"model": MODEL, "max_tokens": 1, "system": "Isolated.", "messages": long}

    def send(key: str) -> float:
        before = _hit_tokens(server)
        reply = httpx.post(
            server.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        return _hit_tokens(server) - before

    assert send("alpha-1") == 0
    assert send("beta-1") == 0  # alpha's cached prefix does not shorten beta's prefill
    assert send("solo-1") == 0
    hit = send("alpha-2")  # alpha's other key: its group's prefix is shared
    assert hit > 0 and hit % 16 == 0
    assert send("beta-1") == hit


# -- the limiter itself, on a fake clock ---------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_limiter_refills_a_minute_allowance_and_counts_running_requests() -> None:
    clock = Clock()
    limiter = RateLimiter(GroupLimits(2, 3, 600), clock)
    limiter.enter("a")
    limiter.enter("a")
    with pytest.raises(RateLimited, match="its limit is 2 at once"):
        limiter.enter("a")
    limiter.enter("b")  # another group's places are its own
    limiter.leave("a")
    limiter.enter("a")  # the third request of a minute of 3
    limiter.leave("a")
    with pytest.raises(RateLimited) as over_rpm:
        limiter.enter("a")
    assert over_rpm.value.retry_after_s == 20  # one request a 20 s at 3 a minute
    clock.now = 20.0
    limiter.enter("a")
    limiter.charge_tokens("a", 590)
    with pytest.raises(RateLimited) as over_tpm:
        limiter.charge_tokens("a", 20)
    assert over_tpm.value.retry_after_s == 1  # 10 tokens short at 10 a second
    with pytest.raises(RateLimited, match="lower max_tokens"):
        limiter.charge_tokens("a", 601)  # more than a minute's allowance: never
    headers = dict(limiter.headers("a", anthropic=False))
    assert headers[b"x-ratelimit-remaining-tokens"] == b"10"
    assert headers[b"x-ratelimit-reset-tokens"] == b"59s"
    assert [go_duration(s) for s in (0.012, 1.5, 360, 3723)] == ["12ms", "1.5s", "6m0s", "1h2m3s"]
