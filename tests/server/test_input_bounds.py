"""Bounds on every field, checked at the gateway (issue 29, point 1), over a real `tokenfleet
serve`: each out-of-range number, count, length or depth is a 400 in the API's own error
format naming the field, on the sync routes and on a batch line alike; nulls the official
APIs accept are accepted; list routes' query parameters are 400s, never 500s or FastAPI's
{"detail": ...}; /openapi.json declares every route's body with its bounds. After all of
it the engine is the one it started with (nothing reached it and took it down)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.api import USER, assert_anthropic_400, assert_openai_400, chat, cmpl, nested
from support.api import post_json as post
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server

pytestmark = pytest.mark.slow

BIG = 2**63 - 1024  # the largest int field value the server (and its schema) takes
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = "/v1/messages"


@pytest.fixture(scope="module")
def server(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("bounds")
    with live_server(folder, "--ttft-target", "60", model_folder=model_folder) as s:
        s.first_engine_pid = s.engine_pid()  # type: ignore[attr-defined]
        yield s
        # Nothing of the module reached the engine and took it down.
        assert s.engine_pid() == s.first_engine_pid  # type: ignore[attr-defined]


def msg(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 1, **fields}


# (route, body, param named) for the OpenAI routes
OPENAI_CASES = [
    (CHAT, chat(seed=BIG, n=2), "seed"),  # seed + 1 past int64
    (CHAT, chat(seed=2**64), "seed"),
    (CHAT, chat(seed=-(2**63) - 1), "seed"),
    (CHAT, chat(top_k=2**64), "top_k"),
    (CHAT, chat(top_k=-2), "top_k"),
    (CHAT, chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    (CHAT, chat(max_tokens=2**64), "max_tokens"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens"),
    (CHAT, chat(temperature=2.5), "temperature"),
    (CHAT, chat(temperature=-0.1), "temperature"),
    (CHAT, chat(top_p=0), "top_p"),
    (CHAT, chat(top_p=1.5), "top_p"),
    (CHAT, chat(presence_penalty=2.1), "presence_penalty"),
    (CHAT, chat(frequency_penalty=-2.1), "frequency_penalty"),
    (CHAT, chat(n=17), "n"),
    (CHAT, chat(n=0), "n"),
    (CHAT, chat(logit_bias={"99999999999999999999999": 1}), "logit_bias"),
    (CHAT, chat(logit_bias={"1000000": 1}), "logit_bias"),  # past the vocabulary
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias.5"),
    (CHAT, chat(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    (CHAT, chat(stop_token_ids=[2**70]), "stop_token_ids.0"),
    (CHAT, chat(stop_token_ids=[1_000_000]), "stop_token_ids"),
    (CHAT, chat(stop_token_ids=[-1]), "stop_token_ids.0"),
    (CHAT, chat(stop=["a"] * 5), "stop"),
    (CHAT, chat(stop="x" * 1025), "stop"),
    (CHAT, chat(stop=["x" * 1025]), "stop.0"),
    (CHAT, chat(messages=[]), "messages"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 10001}]),
        "messages.0.content",
    ),
    (CHAT, chat(metadata=nested(40)), None),  # nesting: the body, no one field
    (CHAT, chat(max_tokens=10**6), "max_tokens"),  # over the context
    (CMPL, cmpl(prompt=[1_000_000]), "prompt"),
    (CMPL, cmpl(prompt=[2**64]), "prompt.0"),
    (CMPL, cmpl(prompt=[[1, 2], [-1]]), "prompt.1.0"),
    (CMPL, cmpl(prompt=["a"] * 20, n=4), "prompt"),  # 80 engine requests, over 64
    (CMPL, cmpl(prompt=["a"] * 2049), "prompt"),
    (CMPL, cmpl(logprobs=6), "logprobs"),
    (CMPL, cmpl(max_tokens=-1), "max_tokens"),
    (CMPL, cmpl(seed=BIG, n=16), "seed"),
    (CMPL, cmpl(top_k=2**63), "top_k"),
]


@pytest.mark.parametrize(("path", "body", "param"), OPENAI_CASES)
def test_an_openai_field_out_of_bounds_is_a_400_naming_it(
    server: LiveServer, path: str, body: dict[str, Any], param: str | None
) -> None:
    assert_openai_400(post(server, path, body), param)  # type: ignore[arg-type]


ANTHROPIC_CASES = [
    (msg(max_tokens=2**64), "max_tokens"),
    (msg(max_tokens=0), "max_tokens"),
    (msg(max_tokens=10**6), "max_tokens"),  # over the context
    (msg(top_k=2**64), "top_k"),
    (msg(top_k=-1), "top_k"),
    (msg(temperature=1.5), "temperature"),
    (msg(top_p=0), "top_p"),
    (msg(stop_sequences=["a"] * 17), "stop_sequences"),
    (msg(stop_sequences=["x" * 1025]), "stop_sequences.0"),
    (msg(metadata={"user_id": "u" * 257}), "metadata.user_id"),
    (msg(metadata={"user_id": "u", "other": nested(3)}), "metadata.other"),
    (msg(metadata=nested(40)), "JSON nested"),
    (msg(messages=[]), "messages"),
    (
        msg(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 10001}]),
        "messages.0.content",
    ),
    (msg(system=[{"type": "text", "text": "a"}] * 10001), "system"),
]


@pytest.mark.parametrize(("body", "field"), ANTHROPIC_CASES)
def test_an_anthropic_field_out_of_bounds_is_a_400_naming_it(
    server: LiveServer, body: dict[str, Any], field: str
) -> None:
    assert_anthropic_400(post(server, MSGS, body), field)


def test_a_body_nested_past_the_decoder_stack_is_a_400_not_a_500(server: LiveServer) -> None:
    deep = b'{"model": "m", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    assert_openai_400(post(server, CHAT, deep), None)  # type: ignore[arg-type]
    response = post(server, MSGS, deep)
    assert response.status_code == 400 and response.json()["error"]["type"] == (
        "invalid_request_error"
    )


def test_nulls_the_official_apis_accept_are_accepted(server: LiveServer) -> None:
    nulls = dict.fromkeys(
        ("temperature", "top_p", "n", "stop", "seed", "stream", "presence_penalty",
         "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "user",
         "stream_options"),
    )  # fmt: skip
    response = post(server, CHAT, chat(**nulls))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    response = post(server, CMPL, {"model": MODEL, "prompt": "Hi", **nulls, "max_tokens": None,
                                   "echo": None})  # fmt: skip
    assert response.status_code == 200, response.text
    nulls = dict.fromkeys(("temperature", "top_p", "top_k", "stop_sequences", "stream",
                           "metadata", "system"))  # fmt: skip
    response = post(server, MSGS, msg(**nulls))
    assert response.status_code == 200, response.text
    response = post(server, MSGS, msg(metadata={"user_id": None}))
    assert response.status_code == 200, response.text


def test_numbers_at_their_bounds_are_served(server: LiveServer) -> None:
    """The largest seed (for n = 1), a top_k past the vocabulary (off) and a huge seed for
    n choices just within it reach the engine and are answered."""
    for body in (
        chat(seed=BIG, temperature=1),
        chat(seed=-(2**63), temperature=1),
        chat(seed=BIG - 1, n=2, temperature=1),
        chat(top_k=BIG, temperature=1, seed=1),
        cmpl(top_k=BIG, seed=BIG - 3, n=4),
    ):
        path = CHAT if "messages" in body else CMPL
        response = post(server, path, body)
        assert response.status_code == 200, (body, response.text)
    response = post(server, MSGS, msg(top_k=BIG))
    assert response.status_code == 200, response.text


LIST_CASES = [
    ("/v1/messages/batches?limit=abc", "limit"),
    ("/v1/messages/batches?limit=0", "limit"),
    ("/v1/messages/batches?limit=99999999999999999999999", "limit"),
    ("/v1/messages/batches?after_id=no%00such", "after_id"),
    ("/v1/messages/batches?before_id=" + "x" * 200, "before_id"),
    ("/v1/messages/batches?after_id=msgbatch_nosuch", "after_id"),
    ("/v1/messages/batches?after_id=a&before_id=b", "before_id"),
    ("/v1/batches?limit=abc", "limit"),
    ("/v1/batches?limit=101", "limit"),
    ("/v1/batches?after=%ff%fe", "after"),
    ("/v1/batches?after=batch_nosuch", "after"),
    ("/v1/files?limit=-1", "limit"),
    ("/v1/files?after=a/b", "after"),
    ("/v1/files?order=asc", "order"),
]


@pytest.mark.parametrize(("url", "param"), LIST_CASES)
def test_a_bad_list_query_is_a_400_in_the_apis_format(
    server: LiveServer, url: str, param: str
) -> None:
    headers = {"anthropic-version": "2023-06-01"} if "messages" in url else {}
    response = httpx.get(server.url + url, headers=headers, timeout=HTTP_TIMEOUT_S)
    if "messages" in url:
        assert_anthropic_400(response, param)
    else:
        assert_openai_400(response, param)


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


def test_a_batch_line_is_bounded_exactly_as_the_sync_api(server: LiveServer) -> None:
    """The same out-of-range values on a batch line: the OpenAI batch fails naming the line
    and field; the Anthropic batch is a 400 naming the request and field."""
    bad_bodies = [
        (chat(seed=BIG, n=2), "body.seed"),
        (chat(top_k=2**64), "body.top_k"),
        (chat(logit_bias={"1000000": 1}), "body.logit_bias"),
        (chat(metadata=nested(40)), "body"),
        (chat(max_tokens=10**6), "body.max_tokens"),
    ]
    for body, param in bad_bodies:
        lines = [
            {"custom_id": "ok", "method": "POST", "url": CHAT, "body": chat()},
            {"custom_id": "bad", "method": "POST", "url": CHAT, "body": body},
        ]
        response = post(
            server,
            "/v1/batches",
            {"input_file_id": upload(server, lines), "endpoint": CHAT, "completion_window": "24h"},
        )
        assert response.status_code == 200, response.text
        batch = response.json()
        assert batch["status"] == "failed", batch
        error = batch["errors"]["data"][0]
        assert (error["line"], error["param"]) == (2, param), error
    lines = [{"custom_id": "x", "method": "POST", "url": CMPL, "body": cmpl(prompt=["a"] * 65)}]
    response = post(
        server,
        "/v1/batches",
        {"input_file_id": upload(server, lines), "endpoint": CMPL, "completion_window": "24h"},
    )
    error = response.json()["errors"]["data"][0]
    assert (error["line"], error["param"]) == (1, "body.prompt"), error

    for params, field in [
        (msg(top_k=BIG + 1), "requests[1].params.top_k"),
        (msg(max_tokens=10**6), "requests[1].params.max_tokens"),
        (msg(metadata=nested(40)), "requests[1].params"),
        (msg(stop_sequences=["a"] * 17), "requests[1].params.stop_sequences"),
    ]:
        body = {
            "requests": [
                {"custom_id": "ok", "params": msg()},
                {"custom_id": "bad", "params": params},
            ]
        }
        assert_anthropic_400(post(server, "/v1/messages/batches", body), field)
    # Past int64 the streaming JSON parser of a Message Batch body refuses the number itself.
    body = {"requests": [{"custom_id": "big", "params": msg(top_k=2**64)}]}
    assert_anthropic_400(post(server, "/v1/messages/batches", body), "malformed JSON body")


def test_openapi_declares_every_routes_body_with_its_bounds(server: LiveServer) -> None:
    spec = httpx.get(f"{server.url}/openapi.json", timeout=HTTP_TIMEOUT_S).json()
    bodies = {
        ("post", "/v1/messages"),
        ("post", "/v1/messages/count_tokens"),
        ("post", "/v1/messages/batches"),
        ("post", "/v1/chat/completions"),
        ("post", "/v1/completions"),
        ("post", "/v1/batches"),
        ("post", "/v1/files"),
    }
    for method, path in bodies:
        assert "requestBody" in spec["paths"][path][method], path
    chat_schema = spec["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]
    props = chat_schema["schema"]["properties"]
    assert props["seed"]["anyOf"][0]["maximum"] == BIG
    assert props["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert props["temperature"]["anyOf"][1] == {"type": "null"}
    msg_schema = spec["paths"][MSGS]["post"]["requestBody"]["content"]["application/json"]
    assert msg_schema["schema"]["properties"]["temperature"]["anyOf"][0]["maximum"] == 1
    assert "max_tokens" in msg_schema["schema"]["required"]
    limit = next(
        p for p in spec["paths"]["/v1/batches"]["get"]["parameters"] if p["name"] == "limit"
    )
    assert limit["schema"]["maximum"] == 100
    assert time.time() > 0


@pytest.mark.fake("runner")
def test_the_engine_requests_cap_is_the_operators_setting_fixed_runner(tmp_path: Path) -> None:
    with live_server(tmp_path, "--runner", "fixed", "--max-engine-requests-per-request", "3") as s:
        assert post(s, CHAT, chat(n=3)).status_code == 200
        over = post(s, CHAT, chat(n=4))
        assert_openai_400(over, "n")
        assert (
            "asks for 4 generations (prompts x n), more than the 3"
            in over.json()["error"]["message"]
        )
        assert post(s, CMPL, cmpl(prompt=["a", "b", "c"])).status_code == 200
        assert_openai_400(post(s, CMPL, cmpl(prompt=["a", "b"], n=2)), "prompt")
