"""Wire fidelity where the official clients read it (issue 29, point 7), over a real
`tokenfleet serve`: the request-id headers of both APIs on every response and in
Anthropic's error bodies; OpenAI's context_length_exceeded; chat logprobs' `bytes` for
tokens that are parts of a multi-byte character; each API's custom_id rule; consecutive
turns of one role merged as the Anthropic API does; result URLs behind a reverse proxy."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server

from tokenfleet.checkpoint.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("wire")
    with live_server(folder, "--ttft-target", "60", model_folder=model_folder) as s:
        yield s


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def gpt(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_every_response_carries_both_request_id_headers(server: LiveServer) -> None:
    calls = [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("GET", "/v1/batches", None),
        ("GET", "/v1/nosuch", None),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 1}),
        ("POST", "/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 1}),
        ("POST", "/v1/messages", {"model": MODEL, "messages": USER}),  # a 400
        ("POST", "/v1/chat/completions", {"model": "nosuch", "messages": USER}),  # a 404
    ]
    seen = set()
    for method, path, body in calls:
        response = httpx.request(method, server.url + path, json=body, timeout=HTTP_TIMEOUT_S)
        rid = response.headers["request-id"]
        assert rid.startswith("req_") and response.headers["x-request-id"] == rid, path
        seen.add(rid)
        if response.status_code >= 400 and path.startswith("/v1/messages"):
            assert response.json()["request_id"] == rid
    assert len(seen) == len(calls)


def test_the_official_clients_read_the_request_id(
    claude: anthropic.Anthropic, gpt: openai.OpenAI
) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=1, messages=USER)  # type: ignore[arg-type]
    assert message._request_id is not None and message._request_id.startswith("req_")
    completion = gpt.chat.completions.create(model=MODEL, max_tokens=1, messages=USER)  # type: ignore[arg-type]
    assert completion._request_id is not None and completion._request_id.startswith("req_")
    with pytest.raises(openai.BadRequestError) as bad:
        gpt.chat.completions.create(model=MODEL, max_tokens=1, messages=[])
    assert bad.value.request_id is not None and bad.value.request_id.startswith("req_")
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=0, messages=USER)  # type: ignore[arg-type]
    assert refused.value.request_id is not None
    assert refused.value.body["request_id"] == refused.value.request_id  # type: ignore[index]


def test_a_context_overflow_has_openais_context_length_exceeded(
    gpt: openai.OpenAI, server: LiveServer
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        gpt.chat.completions.create(model=MODEL, max_tokens=10**6, messages=USER)  # type: ignore[arg-type]
    assert bad.value.status_code == 400 and bad.value.code == "context_length_exceeded"
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as bad:
        gpt.completions.create(model=MODEL, max_tokens=10**6, prompt="Hi")
    assert bad.value.code == "context_length_exceeded"
    response = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": MODEL, "messages": USER, "max_tokens": 10**6},
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_chat_logprob_bytes_of_a_split_character_are_its_own_bytes(
    gpt: openai.OpenAI, model_folder: Path
) -> None:
    """Each token of a text with 2-, 3- and 4-byte characters forced (logit_bias) as a
    chat's one output token: its `bytes` joined in order are the text's UTF-8 exactly
    (a part of a character gives its part, not U+FFFD's three bytes)."""
    text = " 日本語 🐉 é"
    ids = Tokenizer(model_folder).encode(text)
    assert len(ids) > 4  # several characters are split across tokens
    got = b""
    split = 0
    for token_id in ids:
        out = gpt.chat.completions.create(
            model=MODEL,
            messages=USER,  # type: ignore[arg-type]
            max_tokens=1,
            temperature=0,
            logit_bias={str(token_id): 100},
            logprobs=True,
            top_logprobs=0,
        )
        entry = out.choices[0].logprobs.content[0]  # type: ignore[union-attr,index]
        assert entry.bytes is not None
        split += "\ufffd" in entry.token
        got += bytes(entry.bytes)
    assert split > 0
    assert got == text.encode()


def upload(server: LiveServer, lines: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    response = httpx.post(
        f"{server.url}/v1/files",
        files={"file": ("in.jsonl", data)},
        data={"purpose": "batch"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def test_custom_id_follows_each_apis_rule(server: LiveServer) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 1}
    free_ids = ["with space/and ü", "a" * 100, "日本", "x.y:z"]
    lines = [
        {"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": body}
        for c in free_ids
    ]
    response = httpx.post(
        f"{server.url}/v1/batches",
        json={
            "input_file_id": upload(server, lines),
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 200 and response.json()["status"] != "failed", response.text
    assert response.json()["request_counts"]["total"] == len(free_ids)
    bad = [{"custom_id": 5, "method": "POST", "url": "/v1/chat/completions", "body": body}]
    response = httpx.post(
        f"{server.url}/v1/batches",
        json={
            "input_file_id": upload(server, bad),
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.json()["errors"]["data"][0]["param"] == "custom_id"
    for custom_id in ("with space", "a" * 65, "", "ü"):
        response = httpx.post(
            f"{server.url}/v1/messages/batches",
            json={"requests": [{"custom_id": custom_id, "params": body}]},
            timeout=HTTP_TIMEOUT_S,
        )
        assert response.status_code == 400, custom_id
        message = response.json()["error"]["message"]
        assert message.startswith("requests[0].custom_id"), message


def test_consecutive_turns_of_one_role_are_one_turn(
    server: LiveServer, claude: anthropic.Anthropic
) -> None:
    two_turns = [
        {"role": "user", "content": "Hello"},
        {"role": "user", "content": " there"},
        {"role": "assistant", "content": "Hi"},
        {"role": "assistant", "content": "!"},
    ]
    blocks = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]
    one_turn = [{"role": "user", "content": blocks}, {"role": "assistant", "content": "Hi!"}]
    merged = claude.messages.count_tokens(model=MODEL, messages=two_turns)  # type: ignore[arg-type]
    single = claude.messages.count_tokens(model=MODEL, messages=one_turn)  # type: ignore[arg-type]
    assert merged.input_tokens == single.input_tokens
    a, b = (
        httpx.post(
            f"{server.url}/v1/messages",
            json={"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": messages},
            timeout=HTTP_TIMEOUT_S,
        ).json()
        for messages in (two_turns, one_turn)
    )
    assert a["content"] == b["content"]
    # The same prompt, split differently: the second read more of it from the prefix cache.
    assert [u["input_tokens"] + u["cache_read_input_tokens"] for u in (a["usage"], b["usage"])] == [
        merged.input_tokens
    ] * 2
    assert a["usage"]["output_tokens"] == b["usage"]["output_tokens"]


def test_results_url_is_right_behind_a_reverse_proxy(
    server: LiveServer, claude: anthropic.Anthropic
) -> None:
    batch = claude.messages.batches.create(
        requests=[
            {"custom_id": "one", "params": {"model": MODEL, "max_tokens": 1, "messages": USER}}
        ]  # type: ignore[list-item]
    )
    deadline = time.monotonic() + 120
    while claude.messages.batches.retrieve(batch.id).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    path = f"/v1/messages/batches/{batch.id}"
    direct = httpx.get(server.url + path, timeout=HTTP_TIMEOUT_S).json()
    assert direct["results_url"] == f"{server.url}{path}/results"
    proxied = httpx.get(
        server.url + path,
        headers={
            "x-forwarded-proto": "https",
            "x-forwarded-host": "api.example.com",
            "x-forwarded-prefix": "/llm/",
        },
        timeout=HTTP_TIMEOUT_S,
    ).json()
    assert proxied["results_url"] == f"https://api.example.com/llm{path}/results"
    bogus = httpx.get(
        server.url + path,
        headers={"x-forwarded-proto": "javascript", "x-forwarded-host": "a b"},
        timeout=HTTP_TIMEOUT_S,
    ).json()
    assert bogus["results_url"] == direct["results_url"]
    # The official client follows it (through the proxy it would be the proxy's URL).
    results = list(claude.messages.batches.results(batch.id))
    assert [r.custom_id for r in results] == ["one"]


@pytest.mark.fake("runner")
def test_a_configured_public_base_url_wins_over_forwarded_headers_fixed_runner(
    tmp_path: Path,
) -> None:
    public = "https://llm.example.com/tenant-7"
    args = ("--runner", "fixed", "--public-base-url", public + "/")
    with live_server(tmp_path, *args) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        batch = claude.messages.batches.create(
            requests=[
                {"custom_id": "one", "params": {"model": MODEL, "max_tokens": 1, "messages": USER}}
            ]  # type: ignore[list-item]
        )
        deadline = time.monotonic() + 120  # only catches a hang
        while claude.messages.batches.retrieve(batch.id).processing_status != "ended":
            assert time.monotonic() < deadline
            time.sleep(0.1)  # results_url is null until the batch has ended
        path = f"/v1/messages/batches/{batch.id}"
        for headers in ({}, {"x-forwarded-proto": "http", "x-forwarded-host": "other.example"}):
            seen = httpx.get(server.url + path, headers=headers, timeout=HTTP_TIMEOUT_S).json()
            assert seen["results_url"] == f"{public}{path}/results"


def test_a_public_base_url_that_is_no_url_is_refused_at_start_up(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "tokenfleet.cli", "serve", "--public-base-url", "ftp://x/"]
    # The timeout only catches a server that serves instead of refusing.
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert "public_base_url must be an http(s) URL, got 'ftp://x/'" in done.stderr
