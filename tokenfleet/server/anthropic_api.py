"""Anthropic Messages API: POST /v1/messages (JSON or SSE) and /v1/messages/count_tokens."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server.body import read_body
from tokenfleet.server.errors import APIError, anthropic_error_body
from tokenfleet.server.ids import random_hex
from tokenfleet.server.service import (
    ClientDisconnected,
    GenerationService,
    TextDelta,
    cancel_on_disconnect,
)
from tokenfleet.server.sse import EventStream, prime, sse_event
from tokenfleet.server.unsupported import ANTHROPIC_MESSAGES, refuse_unsupported, text_blocks

logger = logging.getLogger(__name__)
router = APIRouter()

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


# Strict: JSON types as they are, no coercion (max_tokens true or "10", stream "yes" are
# 400s, as on Anthropic's API, rather than 1, 10 and True).
class TextBlock(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class MessageParam(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    _text_only = field_validator("content", mode="before")(text_blocks)


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None

    _text_only = field_validator("system", mode="before")(text_blocks)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0, le=1)  # Anthropic's range
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] = Field(default_factory=list, max_length=16)
    stream: bool = False
    metadata: dict[str, Any] | None = None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _check_contents(body: CountTokensRequest) -> None:
    """Anthropic's rules for empty content, with its messages: no empty text block, and no
    empty message but a final assistant one (a prefill of nothing)."""
    contents = [("system", body.system)] if isinstance(body.system, list) else []
    contents += [(f"messages.{i}", m.content) for i, m in enumerate(body.messages)]
    for where, content in contents:
        if isinstance(content, list) and any(not b.text for b in content):
            field = where.split(".")[0]
            raise APIError(
                400, "invalid_request", f"{field}: text content blocks must be non-empty"
            )
    last = len(body.messages) - 1
    for i, m in enumerate(body.messages):
        if not m.content and not (i == last and m.role == "assistant"):
            raise APIError(
                400,
                "invalid_request",
                f"messages.{i}: all messages must have non-empty content except for the "
                "optional final assistant message",
            )


def _check_prefill(body: MessagesRequest) -> None:
    """Anthropic's rule for a prefill (a final assistant turn): it may be empty, but it
    may not end in whitespace."""
    final = body.messages[-1] if body.messages else None
    if final is not None and final.role == "assistant":
        text = _text(final.content)
        if text and text[-1].isspace():
            raise APIError(
                400,
                "invalid_request",
                "messages: final assistant content cannot end with trailing whitespace",
            )


def _prompt(service: GenerationService, body: CountTokensRequest) -> list[int]:
    """The checked conversation's token ids (count_tokens and Messages alike)."""
    refuse_unsupported(body, ANTHROPIC_MESSAGES)
    service.check_model(body.model)
    _check_contents(body)
    messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    if body.system:
        messages.insert(0, {"role": "system", "content": _text(body.system)})
    return service.render_chat(messages, continue_final=True)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    body = await read_body(request, CountTokensRequest)
    return JSONResponse({"input_tokens": len(_prompt(request.app.state.service, body))})


@dataclass
class MessageCall:
    """A validated Messages call: what it sent, its prompt's token ids, sampling params."""

    body: MessagesRequest
    prompt: list[int]
    params: SamplingParams


def prepare_message(service: GenerationService, body: MessagesRequest) -> MessageCall:
    """Every check of a Messages call that needs no engine time."""
    prompt = _prompt(service, body)
    _check_prefill(body)
    service.check_length(len(prompt), body.max_tokens, "max_tokens")
    try:
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
        )
    except InvalidRequestError as exc:
        raise APIError(400, "invalid_request", exc.message, param=exc.param) from exc
    return MessageCall(body, prompt, params)


def _message(call: MessageCall) -> dict[str, Any]:
    return {
        "id": f"msg_{random_hex(24)}",
        "type": "message",
        "role": "assistant",
        "model": call.body.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(call.prompt), "output_tokens": 0},
    }


def _finish(message: dict[str, Any], text: str, last: TextDelta) -> dict[str, Any]:
    message["content"] = [{"type": "text", "text": text}]
    message["stop_reason"] = STOP_REASONS.get(last.finish_reason or "", "end_turn")
    message["stop_sequence"] = last.stop_sequence
    message["usage"] = {
        "input_tokens": message["usage"]["input_tokens"],
        "output_tokens": last.num_output_tokens,
    }
    return message


async def run_message(
    service: GenerationService, call: MessageCall, priority: str
) -> dict[str, Any]:
    """A non-streamed Message (the Batch API's path: never refused for load)."""
    deltas = service.generate(
        call.prompt, call.params, call.body.stop_sequences, route="/v1/messages", priority=priority
    )
    text, last = await _collect(deltas)
    return _finish(_message(call), text, last)


@router.post("/v1/messages", response_model=None)
async def create_message(request: Request) -> Response:
    service: GenerationService = request.app.state.service
    body = await read_body(request, MessagesRequest)
    call = prepare_message(service, body)
    verdict = service.admit(len(call.prompt))
    deltas = await prime(
        service.generate(
            call.prompt,
            call.params,
            body.stop_sequences,
            route="/v1/messages",
            announce=bool(body.stream),
            predicted=verdict,
        )
    )
    message = _message(call)
    if body.stream:
        return EventStream(_stream(message, deltas))
    try:
        text, last = await cancel_on_disconnect(request, _collect(deltas))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the engine request was aborted
    return JSONResponse(_finish(message, text, last))


async def _collect(deltas: AsyncGenerator[TextDelta, None]) -> tuple[str, TextDelta]:
    text, last = "", None
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            text += delta.text
            last = delta
    assert last is not None and last.finish_reason is not None
    return text, last


async def _stream(
    message: dict[str, Any], deltas: AsyncGenerator[TextDelta, None]
) -> AsyncIterator[bytes]:
    yield sse_event({"type": "message_start", "message": message}, "message_start")
    start = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    yield sse_event(start, "content_block_start")
    yield sse_event({"type": "ping"}, "ping")
    last = None
    async with contextlib.aclosing(deltas):
        try:
            async for delta in deltas:
                last = delta
                if delta.text:
                    block = {"type": "text_delta", "text": delta.text}
                    event = {"type": "content_block_delta", "index": 0, "delta": block}
                    yield sse_event(event, "content_block_delta")
        except APIError as exc:
            yield sse_event(anthropic_error_body(exc.kind, exc.message), "error")
            return
        except Exception:
            logger.exception("stream failed after its 200")
            yield sse_event(anthropic_error_body("internal", "internal server error"), "error")
            return
    assert last is not None and last.finish_reason is not None
    yield sse_event({"type": "content_block_stop", "index": 0}, "content_block_stop")
    stop = {
        "stop_reason": STOP_REASONS.get(last.finish_reason, "end_turn"),
        "stop_sequence": last.stop_sequence,
    }
    usage = {"output_tokens": last.num_output_tokens}
    yield sse_event({"type": "message_delta", "delta": stop, "usage": usage}, "message_delta")
    yield sse_event({"type": "message_stop"}, "message_stop")
