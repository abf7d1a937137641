"""A batch's requests, checked before any is accepted: limits, custom ids, and each
request's params exactly as the sync API checks them (same models, same prepare step).

The input (an Anthropic create body or an OpenAI JSONL file) is read twice from a file on
disk, never held whole in memory: once to check every request, then once more to store
them, all in one transaction.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import ijson
from pydantic import BaseModel

from tokenfleet.batch.schema import NewRequest
from tokenfleet.server import anthropic_api, openai_api, openai_chat, openai_completions
from tokenfleet.server.body import parse_body
from tokenfleet.server.bounds import MAX_CUSTOM_ID_CHARS
from tokenfleet.server.errors import APIError
from tokenfleet.server.service import GenerationService

CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
PREFIX_CHARS = 2048  # requests whose first this many characters agree are leased together


@dataclass(frozen=True)
class Endpoint:
    """What a batch may call: its request model and the sync API's own prepare and run
    steps, so a batch request is checked and run exactly as a sync call is."""

    path: str
    model: type[BaseModel]
    prepare: Callable[[GenerationService, Any], Any]
    run_call: Callable[[GenerationService, Any, str], Awaitable[dict[str, Any]]]

    def check(self, service: GenerationService, params: dict[str, Any]) -> None:
        self.prepare(service, parse_body(params, self.model))

    async def run(self, service: GenerationService, params: dict[str, Any]) -> dict[str, Any]:
        call = self.prepare(service, parse_body(params, self.model))
        return await self.run_call(service, call, "batch")


ENDPOINTS = {
    e.path: e
    for e in (
        Endpoint(
            "/v1/messages",
            anthropic_api.MessagesRequest,
            anthropic_api.prepare_message,
            anthropic_api.run_message,
        ),
        Endpoint(
            "/v1/chat/completions",
            openai_api.ChatRequest,
            openai_chat.prepare_chat,
            openai_chat.run_chat,
        ),
        Endpoint(
            "/v1/completions",
            openai_api.CompletionRequest,
            openai_completions.prepare_completion,
            openai_completions.run_completion,
        ),
    )
}
OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def prefix_key(params: dict[str, Any]) -> str:
    """Requests that start alike (a shared system prompt, say) get the same key, so that the
    dispatcher leases them together and the engine's prefix cache serves them."""
    head: Any = [
        params.get("system"),
        params.get("messages", [])[:1],
        params.get("prompt") if isinstance(params.get("prompt"), str) else None,
    ]
    text = json.dumps(head, sort_keys=True, default=str)[:PREFIX_CHARS]
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class BatchChecker:
    """Counts, custom ids and params of one batch's requests, in order; the first problem
    raises a 400 that names the request (`where`: "requests[3]" or "line 4")."""

    def __init__(self, service: GenerationService, max_requests: int) -> None:
        self.service = service
        self.max_requests = max_requests
        self.seen: set[str] = set()

    def check(self, where: str, custom_id: object, endpoint: str, params: object) -> None:
        if len(self.seen) >= self.max_requests:
            raise _bad(f"a batch holds at most {self.max_requests} requests", where)
        _check_custom_id(custom_id, endpoint, where)
        if custom_id in self.seen:
            raise _bad(f"custom_id {custom_id!r} appears twice in the batch", where, "custom_id")
        self.seen.add(custom_id)
        if endpoint not in ENDPOINTS:
            raise _bad(f"unsupported endpoint {endpoint!r}", where, "url")
        if not isinstance(params, dict):
            raise _bad("params must be a JSON object", where, "params")
        if params.get("stream") is not None and params.get("stream") is not False:
            raise _bad("stream is not supported in a batch", where, "params.stream")
        try:
            ENDPOINTS[endpoint].check(self.service, params)
        except APIError as exc:
            field = f"params.{exc.param}" if exc.param else "params"
            # The field goes first once: "requests[3].params.x: ...", not "...x: x: ...".
            message = exc.message.removeprefix(f"{exc.param}: ") if exc.param else exc.message
            raise _bad(message, where, field) from exc


def _check_custom_id(custom_id: object, endpoint: str, where: str) -> None:
    """Each API's own rule: Anthropic's 1 to 64 characters of [a-zA-Z0-9_-]; OpenAI's any
    string (here within MAX_CUSTOM_ID_CHARS, and without NUL, which no store's text holds)."""
    if endpoint == "/v1/messages":
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise _bad(
                "custom_id must be 1 to 64 characters from [a-zA-Z0-9_-], got "
                f"{json.dumps(custom_id)[:80]}",
                where,
                "custom_id",
            )
        return
    if not isinstance(custom_id, str):
        raise _bad(
            f"custom_id must be a string, got {json.dumps(custom_id)[:80]}", where, "custom_id"
        )
    if len(custom_id) > MAX_CUSTOM_ID_CHARS or "\x00" in custom_id:
        raise _bad(
            f"custom_id must be a string of at most {MAX_CUSTOM_ID_CHARS} characters, without NUL",
            where,
            "custom_id",
        )


def _bad(message: str, where: str, field: str | None = None) -> APIError:
    param = f"{where}.{field}" if field else where
    return APIError(400, "invalid_request", f"{param}: {message}", param=param)


# -- the two input formats ---------------------------------------------------------------


def anthropic_requests(source: IO[bytes]) -> Iterator[tuple[str, object, object]]:
    """(where, custom_id, params) of each entry of `{"requests": [...]}`, streamed."""
    try:
        for index, item in enumerate(ijson.items(source, "requests.item", use_float=True)):
            where = f"requests[{index}]"
            if not isinstance(item, dict):
                raise _bad("each request must be a JSON object", where)
            yield where, item.get("custom_id"), item.get("params")
    except ijson.JSONError as exc:
        raise APIError(400, "invalid_request", f"malformed JSON body: {exc}") from exc
    except RecursionError as exc:
        raise APIError(400, "invalid_request", "JSON nested too deeply") from exc


def openai_requests(source: IO[bytes], endpoint: str) -> Iterator[tuple[str, object, str, object]]:
    """(where, custom_id, url, body) of each line of a batch input file, streamed."""
    for number, line in enumerate(source, start=1):
        where = f"line {number}"
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise _bad(f"malformed JSON: {exc}", where) from exc
        except RecursionError as exc:
            raise _bad("JSON nested too deeply", where) from exc
        if not isinstance(item, dict):
            raise _bad("each line must be a JSON object", where)
        if item.get("method", "POST") != "POST":
            raise _bad("method must be POST", where, "method")
        url = item.get("url")
        if url != endpoint:
            raise _bad(f"url {url!r} differs from the batch's endpoint {endpoint!r}", where, "url")
        yield where, item.get("custom_id"), endpoint, item.get("body")


def new_requests(entries: Iterator[tuple[str, object, object]]) -> Iterator[NewRequest]:
    """The stored form of (already checked) entries."""
    for _, custom_id, params in entries:
        assert isinstance(custom_id, str) and isinstance(params, dict)
        yield NewRequest(custom_id, json.dumps(params), prefix_key(params))
