"""Anthropic Messages API: POST /v1/messages (JSON or SSE) and /v1/messages/count_tokens."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server.anthropic_content import (
    Blocks,
    MessageParam,
    TextBlock,
    ToolChoiceParam,
    ToolParam,
    ToolUse,
    check_tool_blocks,
    text_of,
    turn_text,
)
from tokenfleet.server.anthropic_content import tool_use as tool_use_of
from tokenfleet.server.anthropic_output import finish, stream, usage
from tokenfleet.server.body import read_body
from tokenfleet.server.bounds import (
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
from tokenfleet.server.errors import APIError
from tokenfleet.server.ids import random_hex
from tokenfleet.server.schemas import drop_nulls, nullable_fields, request_body
from tokenfleet.server.service import (
    ClientDisconnected,
    GenerationService,
    TextDelta,
    cancel_on_disconnect,
)
from tokenfleet.server.sse import EventStream, prime
from tokenfleet.server.structured import OutputConfig, anthropic_constraint
from tokenfleet.server.tools import render_system, tool_constraint
from tokenfleet.server.unsupported import ANTHROPIC_MESSAGES, refuse_unsupported, text_blocks

logger = logging.getLogger(__name__)
router = APIRouter()


# Strict: JSON types as they are, no coercion (max_tokens true or "10", stream "yes" are
# 400s, as on Anthropic's API, rather than 1, 10 and True). Optional fields sent as null
# read as absent (NULL_IS_DEFAULT); every number, count and length is bounded (bounds.py).
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


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
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None

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


def _check_contents(body: CountTokensRequest) -> None:
    """Anthropic's rules for empty content, with its messages: no empty text block, and no
    empty message but a final assistant one (a prefill of nothing)."""
    contents: list[tuple[str, Any]] = []
    if isinstance(body.system, list):
        contents.append(("system", body.system))
    contents += [(f"messages.{i}", m.content) for i, m in enumerate(body.messages)]
    for where, content in contents:
        if isinstance(content, list) and any(
            isinstance(b, TextBlock) and not b.text for b in content
        ):
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
        text = text_of(final.content)
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
            turns[-1]["content"] += turn_text(m)
        else:
            turns.append({"role": m.role, "content": turn_text(m)})
    return turns


def _prompt(
    service: GenerationService, body: CountTokensRequest
) -> tuple[list[int], ToolUse | None]:
    """The checked conversation's token ids, the tools listed in its system text
    (count_tokens and Messages alike), and how the output may call them."""
    refuse_unsupported(body, ANTHROPIC_MESSAGES)
    service.check_model(body.model)
    _check_contents(body)
    check_tool_blocks(body.messages)
    anthropic_constraint(body.output_config)  # checked here for count_tokens too
    tool_use = tool_use_of(body.tools, body.tool_choice, body.output_config)
    messages = _merged_turns(body.messages)
    system = text_of(body.system) if body.system else ""
    if tool_use is not None:
        system = render_system(system, tool_use.tools)
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return service.render_chat(messages, continue_final=True), tool_use


@router.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
async def count_tokens(request: Request) -> JSONResponse:
    body = await read_body(request, CountTokensRequest)
    prompt, _ = _prompt(request.app.state.service, body)
    return JSONResponse({"input_tokens": len(prompt)})


@dataclass
class MessageCall:
    """A validated Messages call: what it sent, its prompt's token ids, sampling params."""

    body: MessagesRequest
    prompt: list[int]
    params: SamplingParams
    tool_use: ToolUse | None


def prepare_message(service: GenerationService, body: MessagesRequest) -> MessageCall:
    """Every check of a Messages call that needs no engine time."""
    prompt, tool_use = _prompt(service, body)
    _check_prefill(body)
    if tool_use is not None:
        constraint = tool_constraint(tool_use.tools, tool_use.choice)
    else:
        constraint = anthropic_constraint(body.output_config)
    service.check_length(len(prompt), body.max_tokens, "max_tokens")
    try:
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=clamp_temperature(body.temperature),
            top_p=clamp_top_p(body.top_p),
            top_k=clamp_top_k(body.top_k, service.vocab_size),
            constraint=constraint,
        )
    except InvalidRequestError as exc:
        raise APIError(400, "invalid_request", exc.message, param=exc.param) from exc
    return MessageCall(body, prompt, params, tool_use)


def _message(call: MessageCall) -> dict[str, Any]:
    return {
        "id": f"msg_{random_hex(24)}",
        "type": "message",
        "role": "assistant",
        "model": call.body.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(len(call.prompt), TextDelta("", [], 0)),
    }


async def run_message(
    service: GenerationService, call: MessageCall, priority: str
) -> dict[str, Any]:
    """A non-streamed Message (the Batch API's path: never refused for load)."""
    deltas = service.generate(
        call.prompt, call.params, call.body.stop_sequences, route="/v1/messages", priority=priority
    )
    text, last = await _collect(deltas)
    return finish(_message(call), text, last, call.tool_use is not None)


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
        return EventStream(stream(message, deltas, call.tool_use is not None))
    try:
        text, last = await cancel_on_disconnect(request, _collect(deltas))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the engine request was aborted
    return JSONResponse(finish(message, text, last, call.tool_use is not None))


async def _collect(deltas: AsyncGenerator[TextDelta, None]) -> tuple[str, TextDelta]:
    text, last = "", None
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            text += delta.text
            last = delta
    assert last is not None and last.finish_reason is not None
    return text, last
