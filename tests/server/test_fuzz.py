"""Fuzzing a real `tokenfleet serve` (the bundled model) on every route (issue 29).

- schemathesis reads /openapi.json and generates requests for each of its 26 operations
  (ROUTES, checked against the schema), in its positive mode (what the schema describes)
  and its negative mode (what it does not: wrong types, missing fields, other media
  types). Some path ids, cursors and bodies are aimed at what exists (an uploaded file, a
  batch, the served model, the fields a body needs to reach the engine) to get past the
  404 or the first 400. 20 to 40 requests on each route with parameters or a body, 587 in
  all; at least 30 generated bodies on each JSON body route (20 on the file upload).
- hypothesis draws sampling parameters and messages for /v1/messages, /v1/chat/completions
  and /v1/completions (support/fuzz_bodies.py), each field from the values the API takes or
  from those it must refuse: a body of the first only must be answered with a 200 and a
  well-formed reply (or a complete stream), any other with a 4xx. 45 bodies on each route,
  at least MIN_EACH of each kind; and 40 requests with methods and paths outside the
  schema.

On every response: no 5xx, ever; each 4xx in its API's error format (Anthropic's on
/v1/messages*, and on /v1/models with the anthropic-version header; OpenAI's on every
other route), with the request id of its headers; a stream read to its end, without an
error event. Generation is cut short (max_tokens at most 2 or 3, n at most 2) so that the
real model answers each request within a second. Afterwards, with the batches the fuzzing
created ended, a greedy request on each generation route is answered token for token as
it was before the fuzzing, by the same engine process.

Hypothesis runs with a fixed seed (SEED): the same requests on every run; change it to
explore further. Each route's counts are printed.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core import NOT_SET
from support.fuzz_bodies import CHAT_BODIES, COMPLETION_BODIES, MESSAGE_BODIES, Drawn
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server

from tokenfleet.server.anthropic_api import MessagesRequest
from tokenfleet.server.openai_api import ChatRequest, CompletionRequest

pytestmark = pytest.mark.slow

SEED = 29  # hypothesis's seed for every fuzz test
ANTHROPIC_VERSION = {"anthropic-version": "2023-06-01"}
MAX_TOKENS = 2  # schemathesis's bodies are cut to this many tokens and MAX_N choices
MAX_N = 2
CHAT, CMPL, MSGS = "/v1/chat/completions", "/v1/completions", "/v1/messages"
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


@dataclass(frozen=True)
class Budget:
    """A route's requests: how many hypothesis draws, and how many of them must carry a
    generated body (so that a schema that lost a route's body cannot pass)."""

    examples: int
    min_bodies: int = 0

    @property
    def min_requests(self) -> int:
        """Requests that must have been sent: hypothesis stops early only where it has
        drawn every request there is (a route without parameters)."""
        return max(1, self.examples * 3 // 4)


# Every operation of /openapi.json, in the order fuzzed: the deletes last, so that the
# routes before them find the file and batches that exist. One without parameters is one
# request, whatever the number of examples (hypothesis draws the only one there is, once).
ROUTES = {
    "GET /health": Budget(1),
    "GET /health/live": Budget(1),
    "GET /health/ready": Budget(1),
    "GET /metrics": Budget(1),
    "GET /admin/fleet": Budget(1),
    "POST /admin/fleet/scale": Budget(20, min_bodies=10),  # one engine: a 400 at best
    "GET /v1/models": Budget(2),  # with the anthropic-version header, and without
    "GET /v1/models/{model_id}": Budget(20),
    "POST /v1/messages/batches": Budget(40, min_bodies=30),
    "GET /v1/messages/batches": Budget(30),
    "GET /v1/messages/batches/{batch_id}": Budget(20),
    "POST /v1/messages/batches/{batch_id}/cancel": Budget(20),
    "GET /v1/messages/batches/{batch_id}/results": Budget(20),
    "POST /v1/messages/count_tokens": Budget(40, min_bodies=30),
    "POST /v1/messages": Budget(40, min_bodies=30),
    "POST /v1/chat/completions": Budget(40, min_bodies=30),
    "POST /v1/completions": Budget(40, min_bodies=30),
    "POST /v1/files": Budget(30, min_bodies=20),
    "GET /v1/files": Budget(30),
    "GET /v1/files/{file_id}": Budget(20),
    "GET /v1/files/{file_id}/content": Budget(20),
    "POST /v1/batches": Budget(40, min_bodies=30),
    "GET /v1/batches": Budget(30),
    "GET /v1/batches/{batch_id}": Budget(20),
    "POST /v1/batches/{batch_id}/cancel": Budget(20),
    "DELETE /v1/messages/batches/{batch_id}": Budget(20),
    "DELETE /v1/files/{file_id}": Budget(20),
}

# Bodies drawn by support/fuzz_bodies.py for each generation route; at least MIN_EACH of
# them accepted and MIN_EACH refused.
DRAWN = {MSGS: MESSAGE_BODIES, CHAT: CHAT_BODIES, CMPL: COMPLETION_BODIES}
DRAWN_EXAMPLES = 45
MIN_EACH = 8


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # no shrinking: each example is a request to a real server
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


# -- the server, and what exists on it ------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # No admission refusals or rate limits (4xx in the right format, but they would stop
    # requests before the checks worth fuzzing); batches of at most 4 requests.
    args = ["--ttft-target", "3600", "--requests-per-minute-per-group", "0"]
    args += ["--tokens-per-minute-per-group", "0", "--max-batch-requests", "4"]
    with live_server(tmp_path_factory.mktemp("fuzz"), *args, model_folder=model_folder) as s:
        s.first_engine_pid = s.engine_pid()  # type: ignore[attr-defined]
        yield s


GREEDY = [
    (CHAT, {"messages": [{"role": "user", "content": "Name three colors."}], "logprobs": True}),
    (MSGS, {"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    (CMPL, {"prompt": "The first three prime numbers are", "logprobs": 0}),
]


def greedy_answers(server: LiveServer) -> list[tuple[str, list[str] | int]]:
    """Each generation route's greedy answer: its text, and its tokens (or their count)."""
    answers: list[tuple[str, list[str] | int]] = []
    for path, fields in GREEDY:
        body = {"model": MODEL, "max_tokens": 16, "temperature": 0, **fields}
        response = httpx.post(server.url + path, json=body, timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 200, response.text
        reply = response.json()
        if path == CHAT:
            choice = reply["choices"][0]
            tokens = [t["token"] for t in choice["logprobs"]["content"]]
            answers.append((choice["message"]["content"], tokens))
        elif path == MSGS:
            answers.append((reply["content"][0]["text"], reply["usage"]["output_tokens"]))
        else:
            choice = reply["choices"][0]
            answers.append((choice["text"], choice["logprobs"]["tokens"]))
    assert all(text for text, _ in answers), answers
    return answers


@pytest.fixture(scope="module")
def greedy_before(server: LiveServer) -> list[tuple[str, list[str] | int]]:
    """The greedy answers before any fuzzing (every fuzz test asks for this first)."""
    return greedy_answers(server)


@dataclass(frozen=True)
class Existing:
    """Ids of things that exist on the server, for generated requests to aim at."""

    file_id: str  # a valid batch input file
    openai_batch_id: str
    anthropic_batch_id: str
    # every file uploaded: file_id's, then those of the generated uploads that succeeded
    uploads: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def existing(server: LiveServer, greedy_before: Any) -> Existing:
    line = {"custom_id": "a", "method": "POST", "url": CHAT, "body": small_chat()}
    upload = httpx.post(
        f"{server.url}/v1/files",
        files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
        data={"purpose": "batch"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    create = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    openai_batch = httpx.post(f"{server.url}/v1/batches", json=create, timeout=HTTP_TIMEOUT_S)
    assert openai_batch.status_code == 200, openai_batch.text
    params = {**small_chat(), "max_tokens": 1}
    anthropic_batch = httpx.post(
        f"{server.url}/v1/messages/batches",
        json={"requests": [{"custom_id": "a", "params": params}]},
        timeout=HTTP_TIMEOUT_S,
    )
    assert anthropic_batch.status_code == 200, anthropic_batch.text
    ids = (file_id, openai_batch.json()["id"], anthropic_batch.json()["id"])
    return Existing(*ids, uploads=[file_id])


def small_chat() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


# The fields of a body that a generated one must get right to reach the engine.
CORE_FIELDS = {
    MSGS: small_chat(),
    CHAT: small_chat(),
    CMPL: {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
}


@pytest.fixture(scope="module")
def schema(server: LiveServer) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


# -- what every response must be ------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What the checks read of a response, from schemathesis's or httpx's alike."""

    status: int
    headers: dict[str, str]  # names in lower case
    text: str
    anthropic: bool  # whether the server answers the request in Anthropic's format

    @classmethod
    def of(cls, response: schemathesis.Response | httpx.Response) -> Reply:
        if isinstance(response, httpx.Response):
            headers = {k.lower(): v for k, v in response.headers.items()}
        else:  # schemathesis's: each header's values as a list
            assert not response.stream_cut_short, "an event stream not read to its end"
            headers = {k.lower(): v[0] for k, v in response.headers.items()}
        # errors.py: Anthropic's routes, and /v1/models with the anthropic-version header
        path = unquote(urlsplit(str(response.request.url)).path)
        anthropic = path.startswith(MSGS) or (
            path.startswith("/v1/models") and "anthropic-version" in response.request.headers
        )
        text = response.content.decode(errors="replace")
        return cls(response.status_code, headers, text, anthropic)


def assert_api_reply(response: schemathesis.Response | httpx.Response, what: str) -> None:
    """No 5xx; a 4xx in its API's format; a stream complete, without an error event; the
    request id in both APIs' headers."""
    reply = Reply.of(response)
    status = reply.status
    assert status < 500, f"{status} for {what}: {reply.text[:2000]}"
    rid = reply.headers.get("request-id")
    assert rid and reply.headers.get("x-request-id") == rid, (what, reply.headers)
    if status >= 400:
        try:
            body = json.loads(reply.text)
        except ValueError:
            raise AssertionError(f"{status} without a JSON body: {what}: {reply.text}") from None
        if reply.anthropic:
            assert_anthropic_error(body, status, rid, what)
        else:
            assert_openai_error(body, status, what)
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        assert_stream_complete(reply.text, reply.anthropic, what)


def assert_anthropic_error(body: Any, status: int, rid: str, what: str) -> None:
    assert isinstance(body, dict) and set(body) == {"type", "error", "request_id"}, (what, body)
    assert body["type"] == "error" and body["request_id"] == rid, (what, body)
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"type", "message"}, (what, body)
    assert isinstance(error["message"], str) and error["message"], (what, body)
    assert error["type"] == ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error"), (
        what,
        status,
        body,
    )


def assert_openai_error(body: Any, status: int, what: str) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, (what, body)
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, (
        what,
        body,
    )
    assert isinstance(error["message"], str) and error["message"], (what, body)
    if status != 429:  # (a rate limit's type is `requests` or `tokens`, as OpenAI's)
        assert error["type"] == "invalid_request_error", (what, body)
    assert error["param"] is None or isinstance(error["param"], str), (what, body)
    assert error["code"] is None or isinstance(error["code"], str), (what, body)


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each event of a text/event-stream body."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data.append(line.removeprefix("data: "))
        events.append((name, "\n".join(data)))
    return events


def assert_stream_complete(text: str, anthropic: bool, what: str) -> None:
    events = sse_events(text)
    if anthropic:
        names = [name for name, _ in events]
        assert names[0] == "message_start" and names[-1] == "message_stop", (what, text)
        assert "error" not in names, (what, text)
    else:
        assert events[-1][1] == "[DONE]", (what, text)
        for _, data in events[:-1]:
            assert "error" not in json.loads(data), (what, text)


# -- schemathesis: every route of the schema ------------------------------------------------


def bound_cost(path: str, body: object) -> None:
    """Cut a generated body's generation to MAX_TOKENS tokens and MAX_N choices, where the
    server would accept it (read as the server reads it, by its own request model): a body
    with max_tokens 4000, or none (to the end of the context), would take the real model
    minutes. A body the server refuses is left as it is."""
    if not isinstance(body, dict):
        return
    if path == "/v1/messages/batches":
        for item in body.get("requests") or ():
            if isinstance(item, dict) and isinstance(item.get("params"), dict):
                bound_cost(MSGS, item["params"])
        return
    model = {MSGS: MessagesRequest, CHAT: ChatRequest, CMPL: CompletionRequest}.get(path)
    if model is None:
        return
    try:
        read = model.model_validate(body)
    except Exception:
        return  # refused: nothing generated
    if isinstance(read, ChatRequest) and read.max_completion_tokens:
        body["max_completion_tokens"] = min(read.max_completion_tokens, MAX_TOKENS)
    elif read.max_tokens is None or read.max_tokens > MAX_TOKENS:
        body["max_tokens"] = MAX_TOKENS
    if getattr(read, "n", 1) > MAX_N:
        body["n"] = MAX_N


def aim(case: schemathesis.Case, data: st.DataObject, existing: Existing) -> None:
    """Point some of a generated request's parts at what exists (an uploaded file, a
    batch, the served model), or overlay the fields a body needs to reach the engine,
    keeping the generated others (sampling parameters, metadata, unknown fields): so that
    a request gets past the 404 or the first 400 to the checks behind it."""
    anthropic_route = case.path.startswith(MSGS)
    batch_id = existing.anthropic_batch_id if anthropic_route else existing.openai_batch_id
    ids = {"batch_id": batch_id, "file_id": existing.file_id, "model_id": MODEL}
    for name in case.path_parameters or {}:
        if name in ids and data.draw(st.booleans(), label=f"aim {name}"):
            case.path_parameters[name] = ids[name]
    cursors = {"after_id": batch_id, "before_id": batch_id, "after": batch_id}
    if case.path == "/v1/files":
        cursors["after"] = existing.file_id
    for name in case.query or {}:
        if name in cursors and data.draw(st.booleans(), label=f"aim {name}"):
            case.query[name] = cursors[name]
    body = case.body
    if not isinstance(body, dict):
        return
    aimed = data.draw(st.sampled_from(["as generated", "model", "core fields"]), label="aim body")
    if aimed == "as generated":
        return
    core = CORE_FIELDS.get(case.path, {})
    if case.path in CORE_FIELDS:
        body.update(core if aimed == "core fields" else {"model": MODEL})
    for item in body.get("requests") or ():  # a Message Batch's requests
        if isinstance(item, dict) and isinstance(item.get("params"), dict):
            item["params"].update(small_chat() if aimed == "core fields" else {"model": MODEL})
    if case.path == "/v1/batches":
        file_id = data.draw(st.sampled_from(existing.uploads), label="input file")
        body.update(input_file_id=file_id, endpoint=CHAT, completion_window="24h")


@dataclass
class Tally:
    requests: int = 0
    bodies: int = 0
    statuses: Counter[int] = field(default_factory=Counter)

    def line(self, label: str) -> str:
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return f"{label}: {self.requests} requests, {self.bodies} bodies ({statuses})"


def test_the_fuzzed_routes_are_every_route_of_the_schema(schema: schemathesis.BaseSchema) -> None:
    labels = {result.ok().label for result in schema.get_all_operations()}
    assert labels == set(ROUTES)


@pytest.mark.parametrize("label", ROUTES)
def test_schemathesis_finds_no_5xx_and_no_foreign_error_format(
    server: LiveServer,
    schema: schemathesis.BaseSchema,
    existing: Existing,
    label: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    method, path = label.split(" ", 1)
    operation = schema[path][method]
    cases = st.one_of(
        operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )
    budget = ROUTES[label]
    tally = Tally()
    session = requests.Session()

    @seed(SEED)
    @fuzz_settings(budget.examples)
    @given(case=cases, data=st.data())
    def fuzz(case: schemathesis.Case, data: st.DataObject) -> None:
        aim(case, data, existing)
        bound_cost(path, case.body)
        headers = (
            ANTHROPIC_VERSION
            if path.startswith("/v1/models") and data.draw(st.booleans(), label="anthropic-version")
            else None
        )
        response = case.call(
            base_url=server.url, session=session, headers=headers, timeout=HTTP_TIMEOUT_S
        )
        tally.requests += 1
        tally.bodies += case.body is not NOT_SET
        tally.statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error], headers=headers)
        assert_api_reply(response, case.as_curl_command(headers=headers))
        if label == "POST /v1/files" and response.status_code == 200:
            existing.uploads.append(response.json()["id"])  # batch input for POST /v1/batches

    fuzz()
    with capsys.disabled():
        print(f"\n[fuzz seed {SEED}] schemathesis {tally.line(label)}")
    assert tally.requests >= budget.min_requests, tally
    assert tally.bodies >= budget.min_bodies, tally


METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
PATH_STEMS = sorted({label.split(" ", 1)[1].split("{")[0].rstrip("/") for label in ROUTES})
STRANGER_PATHS = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from([*PATH_STEMS, "", "/v1", "/v2/messages", "/docs"]),
    st.one_of(st.just(""), st.just("/"), st.text("abz/._%-~", max_size=12).map("/".__add__)),
)
UNROUTED_EXAMPLES = 40


def test_paths_and_methods_outside_the_schema_are_refused_in_the_apis_format(
    server: LiveServer, greedy_before: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """What schemathesis never sends: a method a route does not take, a path no route
    has (FastAPI's own 404 and 405 are {"detail": ...} unless the app reformats them)."""
    tally = Tally()
    client = httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT_S)

    @seed(SEED)
    @fuzz_settings(UNROUTED_EXAMPLES)
    @given(method=st.sampled_from(METHODS), path=STRANGER_PATHS, anthropic=st.booleans())
    def fuzz(method: str, path: str, anthropic: bool) -> None:
        headers = ANTHROPIC_VERSION if anthropic else {}
        response = client.request(method, path, headers=headers)
        tally.requests += 1
        tally.statuses[response.status_code] += 1
        assert_api_reply(response, f"{method} {path} {headers}")

    fuzz()
    with capsys.disabled():
        print(f"\n[fuzz seed {SEED}] hypothesis {tally.line('other paths and methods')}")
    assert tally.requests >= UNROUTED_EXAMPLES * 3 // 4, tally
    assert tally.statuses[404] and tally.statuses[405], tally


# -- hypothesis: sampling parameters and messages ---------------------------------------


def assert_reply_answers(path: str, body: dict[str, Any], response: httpx.Response) -> None:
    """An accepted body's 200: every choice there, each within its max_tokens."""
    limit = body.get("max_completion_tokens") or body["max_tokens"] or 1
    n = body.get("n") or 1
    if body.get("stream"):
        return  # complete, without an error event: assert_api_reply saw to it
    reply = response.json()
    if path == MSGS:
        assert reply["type"] == "message" and reply["role"] == "assistant", reply
        assert reply["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence"), reply
        assert 1 <= reply["usage"]["output_tokens"] <= limit, (body, reply)
        return
    prompts = 1
    if path == CMPL and isinstance(body["prompt"], list) and not isinstance(body["prompt"][0], int):
        prompts = len(body["prompt"])
    assert [c["index"] for c in reply["choices"]] == list(range(prompts * n)), reply
    assert all(c["finish_reason"] in ("stop", "length") for c in reply["choices"]), reply
    assert reply["usage"]["completion_tokens"] <= limit * prompts * n, (body, reply)


@pytest.mark.parametrize("path", DRAWN)
def test_drawn_sampling_params_and_messages_are_served_or_refused_as_the_api_says(
    server: LiveServer, greedy_before: Any, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tally = Tally()
    accepted = refused = 0
    client = httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT_S)

    @seed(SEED)
    @fuzz_settings(DRAWN_EXAMPLES)
    @given(drawn=DRAWN[path])
    def fuzz(drawn: Drawn) -> None:
        nonlocal accepted, refused
        response = client.post(path, json=drawn.body)
        tally.requests += 1
        tally.bodies += 1
        tally.statuses[response.status_code] += 1
        what = f"POST {path} {json.dumps(drawn.body)[:3000]}"
        assert_api_reply(response, what)
        if drawn.valid:
            assert response.status_code == 200, (what, response.text)
            assert_reply_answers(path, drawn.body, response)
            accepted += 1
        else:
            assert 400 <= response.status_code < 500, (what, response.text)
            refused += 1

    fuzz()
    with capsys.disabled():
        print(f"\n[fuzz seed {SEED}] hypothesis {tally.line('POST ' + path)}")
    assert tally.bodies >= DRAWN_EXAMPLES - 5, tally
    assert accepted >= MIN_EACH and refused >= MIN_EACH, (accepted, refused)


# -- what the fuzzing found -------------------------------------------------------------


@pytest.mark.parametrize("path", DRAWN)
@pytest.mark.parametrize("stream", [False, True])
def test_a_subnormal_top_p_is_served(server: LiveServer, path: str, stream: bool) -> None:
    """5e-324 is in the APIs' (0, 1]; the engine process, with subnormals flushed to zero,
    read it as 0 and refused the request, after a stream's 200 as an error event."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "top_p": 5e-324, "stream": stream}
    if path == CMPL:
        body["prompt"] = "Hi"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    response = httpx.post(server.url + path, json=body, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert_api_reply(response, f"POST {path} {body}")  # a stream: complete, no error event


# -- afterwards --------------------------------------------------------------------------


def end_batches(server: LiveServer) -> int:
    """Cancel every batch still running (the fuzzing created some) and wait until each has
    ended; the number cancelled."""
    running: list[str] = []
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT_S) as client:
        for batch in listed(client, "/v1/messages/batches", "after_id"):
            if batch["processing_status"] != "ended":
                running.append(f"/v1/messages/batches/{batch['id']}")
        for batch in listed(client, "/v1/batches", "after"):
            if batch["status"] in ("validating", "in_progress", "finalizing", "cancelling"):
                running.append(f"/v1/batches/{batch['id']}")
        for url in running:
            assert client.post(url + "/cancel").status_code == 200

        def ended(url: str) -> bool:
            batch = client.get(url).json()
            state = batch.get("processing_status") or batch.get("status")
            return state in ("ended", "cancelled", "completed", "failed", "expired")

        server.wait_until(lambda: all(ended(url) for url in running), "batches ended")
    return len(running)


def listed(client: httpx.Client, path: str, cursor: str) -> Iterator[dict[str, Any]]:
    params: dict[str, Any] = {"limit": 100}
    while True:
        page = client.get(path, params=params)
        assert page.status_code == 200, page.text
        body = page.json()
        yield from body["data"]
        if not body["has_more"]:
            return
        params[cursor] = body["last_id"]


def test_after_the_fuzzing_greedy_requests_are_answered_exactly_as_before(
    server: LiveServer, greedy_before: list[tuple[str, list[str] | int]]
) -> None:
    """Placed last: after every fuzz test of the module (each asks for greedy_before first,
    so it holds the answers from before any of them)."""
    end_batches(server)
    assert greedy_answers(server) == greedy_before
    assert server.engine_pid() == server.first_engine_pid  # type: ignore[attr-defined]
