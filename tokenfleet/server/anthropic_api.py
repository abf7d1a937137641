"""Anthropic Messages API: POST /v1/messages (JSON or SSE) and /v1/messages/count_tokens."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server.body import read_body
from tokenfleet.server.bounds import (
    MAX_CONTENT_BLOCKS,
    MAX_MESSAGES,
    MAX_METADATA_USER_ID,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES_ANTHROPIC,
    MAX_TOKENS_MAX,
    TOP_K_MAX,
    clamp_temperature,
    clamp_top_k,
    clamp_top_p,
)
from tokenfleet.server.errors import APIError, anthropic_error_body
from tokenfleet.server.ids import random_hex
from tokenfleet.server.schemas import drop_nulls, nullable_fields, request_body
from tokenfleet.server.service import (
    ClientDisconnected,
    GenerationService,
    TextDelta,
    cancel_on_disconnect,
)
from tokenfleet.server.sse import EventStream, prime, sse_event
from tokenfleet.server.structured import OutputConfig, anthropic_constraint
from tokenfleet.server.unsupported import ANTHROPIC_MESSAGES, refuse_unsupported, text_blocks

logger = logging.getLogger(__name__)
router = APIRouter()

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


# Strict: JSON types as they are, no coercion (max_tokens true or "10", stream "yes" are
# 400s, as on Anthropic's API, rather than 1, 10 and True). Optional fields sent as null
# read as absent (NULL_IS_DEFAULT); every number, count and length is bounded (bounds.py).
class TextBlock(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


Blocks = Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_BLOCKS)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class MessageParam(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["user", "assistant"]
    content: str | Blocks

    _text_only = field_validator("content", mode="before")(text_blocks)


class Metadata(BaseModel):
    """Anthropic's request metadata: a user id and nothing else."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=nullable_fields)

    user_id: str | None = Field(None, max_length=MAX_METADATA_USER_ID)


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=nullable_fields)
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("system",)

    model: str
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | Blocks | None = None
    output_config: OutputConfig | None = None

    _text_only = field_validator("system", mode="before")(text_blocks)
    _nulls = model_validator(mode="before")(drop_nulls)


class MessagesRequest(CountTokensRequest):
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "metadata",
    )

    max_tokens: int = Field(ge=1, le=MAX_TOKENS_MAX)
    temperature: float = Field(1.0, ge=0, le=1)  # Anthropic's range
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=TOP_K_MAX)
    stop_sequences: list[StopString] = Field(
        default_factory=list, max_length=MAX_STOP_SEQUENCES_ANTHROPIC
    )
    stream: bool = False
    metadata: Metadata | None = None


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


def _merged_turns(messages: list[MessageParam]) -> list[dict[str, str]]:
    """The conversation's turns: consecutive messages of the same role are one turn, as
    the Anthropic API combines them (their text joined as one message's text blocks are)."""
    turns: list[dict[str, str]] = []
    for m in messages:
        if turns and turns[-1]["role"] == m.role:
            turns[-1]["content"] += _text(m.content)
        else:
            turns.append({"role": m.role, "content": _text(m.content)})
    return turns


def _prompt(service: GenerationService, body: CountTokensRequest) -> list[int]:
    """The checked conversation's token ids (count_tokens and Messages alike)."""
    refuse_unsupported(body, ANTHROPIC_MESSAGES)
    service.check_model(body.model)
    _check_contents(body)
    anthropic_constraint(body.output_config)  # checked here for count_tokens too
    messages = _merged_turns(body.messages)
    if body.system:
        messages.insert(0, {"role": "system", "content": _text(body.system)})
    return service.render_chat(messages, continue_final=True)


@router.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
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
            temperature=clamp_temperature(body.temperature),
            top_p=clamp_top_p(body.top_p),
            top_k=clamp_top_k(body.top_k, service.vocab_size),
            constraint=anthropic_constraint(body.output_config),
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
        "usage": _usage(len(call.prompt), TextDelta("", [], 0)),
    }


def _usage(num_prompt: int, delta: TextDelta) -> dict[str, int]:
    """Usage as Anthropic defines it: `input_tokens` are the prompt tokens not read from
    the prefix cache, `cache_read_input_tokens` those that were (nothing is written to a
    cache at a caller's request: `cache_creation_input_tokens` is 0)."""
    return {
        "input_tokens": num_prompt - delta.num_cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": delta.num_cached_tokens,
        "output_tokens": delta.num_output_tokens,
    }


def _finish(message: dict[str, Any], text: str, last: TextDelta) -> dict[str, Any]:
    message["content"] = [{"type": "text", "text": text}]
    message["stop_reason"] = STOP_REASONS.get(last.finish_reason or "", "end_turn")
    message["stop_sequence"] = last.stop_sequence
    num_prompt = message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"]
    message["usage"] = _usage(num_prompt, last)
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


@router.post("/v1/messages", response_model=None, openapi_extra=request_body(MessagesRequest))
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
    """The events of a streamed Message. message_start goes out before the first token,
    when the prefix cache's share of the prompt is not known yet: its usage counts the
    whole prompt as input; message_delta's usage has the final counts, cache reads
    included (the SDKs' accumulators take them from there)."""
    num_prompt = message["usage"]["input_tokens"]
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
    usage = _usage(num_prompt, last)
    yield sse_event({"type": "message_delta", "delta": stop, "usage": usage}, "message_delta")
    yield sse_event({"type": "message_stop"}, "message_stop")
