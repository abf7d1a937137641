"""One request to an Anthropic- or OpenAI-compatible endpoint, streamed over httpx and timed
event by event.

A request's record holds what the report needs: when it was sent, when each content event
arrived, how many tokens the server says it produced (the usage it reports at the end:
`stream_options.include_usage` on OpenAI, `message_delta` on Anthropic; the number of
content events where a server reports none) and how it ended:

    ok          a 200 stream that ran to its end
    refused     HTTP 429, 503 or 529 (overloaded): counted, never retried
    errored     any other status, an error event, a transport error, a timeout
    unfinished  still running, or not yet sent, when the run's drain limit passed
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from tokenfleet.loadgen.workload import RequestSpec

REFUSAL_STATUSES = frozenset({429, 503, 529})
ANTHROPIC_VERSION = "2023-06-01"
APIS = ("openai", "anthropic")

Status = Literal["pending", "ok", "refused", "errored", "unfinished"]


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds since the run's start."""

    req_id: str
    kind: str
    prompt_len: int
    output_len: int  # requested
    status: Status = "pending"
    http_status: int | None = None
    error: str | None = None
    sent_s: float | None = None
    done_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # each content event's arrival
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    usage_reported: bool = False  # False: output_tokens counts content events

    @classmethod
    def of(cls, spec: RequestSpec) -> RequestRecord:
        return cls(spec.req_id, spec.kind, spec.prompt_len, spec.output_len)

    @property
    def ttft_s(self) -> float | None:
        if self.status != "ok" or self.sent_s is None or not self.token_times_s:
            return None
        return self.token_times_s[0] - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / (output tokens - 1); None below two tokens."""
        if self.ttft_s is None or self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_tokens - 1)

    def finish(self, status: Status, now: float, error: str | None = None) -> None:
        self.status, self.done_s, self.error = status, now, error


@dataclass(frozen=True)
class Endpoint:
    """Where requests go and how they are written."""

    url: str  # http://host:port, without /v1
    api: str  # "openai" (/v1/chat/completions) or "anthropic" (/v1/messages)
    model: str
    api_key: str | None = None
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {self.api!r}")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "openai" else "/v1/messages"

    def headers(self) -> dict[str, str]:
        headers = {"anthropic-version": ANTHROPIC_VERSION} if self.api == "anthropic" else {}
        if self.api_key:
            headers |= {"x-api-key": self.api_key, "authorization": f"Bearer {self.api_key}"}
        return headers

    def body(self, spec: RequestSpec, prompt: str, *, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": spec.output_len,
        }
        if stream:
            body["stream"] = True
            if self.api == "openai":
                body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


class _StreamError(Exception):
    """An error event inside a 200 stream."""


def _error_message(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(payload)[:500]


def _on_openai(event: dict[str, Any], record: RequestRecord, now: float) -> None:
    if "error" in event:
        raise _StreamError(_error_message(event))
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        # With logprobs asked for, a chunk per step also for tokens that show no text
        # (special ones, a character's first bytes): their arrivals count too.
        logprobs = (choice.get("logprobs") or {}).get("content")
        if delta.get("content") or delta.get("reasoning_content") or logprobs:
            record.token_times_s.append(now)
    usage = event.get("usage")
    if usage:
        record.output_tokens = int(usage["completion_tokens"])
        record.prompt_tokens = int(usage["prompt_tokens"])
        record.usage_reported = True


def _on_anthropic(event: dict[str, Any], record: RequestRecord, now: float) -> None:
    kind = event.get("type")
    if kind == "error":
        raise _StreamError(_error_message(event))
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        if delta.get("text") or delta.get("thinking"):
            record.token_times_s.append(now)
    elif kind == "message_start":
        usage = (event.get("message") or {}).get("usage") or {}
        if "input_tokens" in usage:
            record.prompt_tokens = int(usage["input_tokens"])
    elif kind == "message_delta" and "output_tokens" in (event.get("usage") or {}):
        record.output_tokens = int(event["usage"]["output_tokens"])
        record.usage_reported = True


async def stream_request(
    http: httpx.AsyncClient,
    endpoint: Endpoint,
    spec: RequestSpec,
    prompt: str,
    record: RequestRecord,
    clock: Callable[[], float],
    *,
    timeout_s: float,
    priority: int | None = None,
) -> None:
    """Send one streamed request and fill in `record`; every failure ends up in the record
    (status and error), only a cancellation propagates."""
    body = endpoint.body(spec, prompt, stream=True)
    if priority is not None:  # vLLM's field; servers that do not know it ignore it
        body["priority"] = priority
    on_event = _on_openai if endpoint.api == "openai" else _on_anthropic
    record.sent_s = clock()
    try:
        async with asyncio.timeout(timeout_s):
            response_cm = http.stream("POST", endpoint.url + endpoint.path, json=body)
            async with response_cm as response:
                record.http_status = response.status_code
                if response.status_code >= 400:
                    await response.aread()
                    try:
                        message = _error_message(response.json())
                    except ValueError:
                        message = response.text[:500]
                    refused = response.status_code in REFUSAL_STATUSES
                    record.finish("refused" if refused else "errored", clock(), message)
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    on_event(json.loads(data), record, clock())
    except asyncio.CancelledError:
        record.finish("unfinished", clock(), "the run's drain limit passed")
        raise
    except TimeoutError:
        record.finish("errored", clock(), f"no complete answer within {timeout_s} s")
        return
    except (_StreamError, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        record.finish("errored", clock(), f"{type(exc).__name__}: {exc}")
        return
    if record.output_tokens is None:
        record.output_tokens = len(record.token_times_s)
    record.finish("ok", clock())
