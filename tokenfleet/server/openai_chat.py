"""OpenAI Chat Completions: POST /v1/chat/completions (JSON or SSE chunks)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.core.engine_api import TokenLogprobs
from tokenfleet.core.sampling_params import Constraint
from tokenfleet.server.bounds import check_engine_requests
from tokenfleet.server.errors import APIError, openai_error_body
from tokenfleet.server.openai_api import (
    FINISH_REASONS,
    ChatRequest,
    Run,
    reply,
    token_bytes,
    token_text,
)
from tokenfleet.server.openai_tools import ToolDeltas, chat_messages, chat_tools
from tokenfleet.server.schemas import request_body
from tokenfleet.server.service import GenerationService, TextDelta
from tokenfleet.server.sse import EventStream, prime, sse_event
from tokenfleet.server.structured import openai_constraint
from tokenfleet.server.unsupported import OPENAI_CHAT, OPENAI_MESSAGE, refuse_unsupported

router = APIRouter()


def _chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": token_bytes(tokenizer, token_id, text)}

    return [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
        for e in entries
    ]


@router.post("/v1/chat/completions", response_model=None, openapi_extra=request_body(ChatRequest))
async def chat_completions(request: Request) -> Response:
    return await reply(request, ChatRequest, _chat_completions)


@dataclass
class ChatCall:
    """A validated chat completion call: what it sent, and its prompt's token ids."""

    body: ChatRequest
    prompt: list[int]
    max_tokens: int
    num_top: int | None  # top logprobs per token; None: no logprobs
    constraint: Constraint | None  # what the output must match (response_format, tools)
    tools: bool  # whether the output is read back as text and calls (openai_tools.py)


def prepare_chat(service: GenerationService, body: ChatRequest) -> ChatCall:
    """Every check of a chat completion call that needs no engine time."""
    service.check_model(body.model)
    body.stop_list()
    body.check_stream_options()
    refuse_unsupported(body, OPENAI_CHAT)
    for i, m in enumerate(body.messages):
        refuse_unsupported(m, OPENAI_MESSAGE, f"messages.{i}.")
    body.check_bounds(service.vocab_size)
    check_engine_requests(body.n, service.config.max_engine_requests_per_request, "n")
    tools = chat_tools(body)
    messages = chat_messages(body.messages, tools)
    mentions_json = any("json" in m["content"].lower() for m in messages)
    constraint = tools.constraint() or openai_constraint(body.response_format, mentions_json)
    prompt = service.render_chat(messages)
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = max(service.max_model_len - len(prompt), 1)
    service.check_length(len(prompt), max_tokens, param)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    return ChatCall(body, prompt, max_tokens, num_top, constraint, tools.active)


async def run_chat(service: GenerationService, call: ChatCall, priority: str) -> dict[str, Any]:
    """A non-streamed chat completion, as its JSON body (the Batch API's path)."""
    run = Run(service, call.body, "/v1/chat/completions", priority)
    n = call.body.n
    merged = run.start(
        [call.prompt] * n, [call.max_tokens] * n, call.num_top, constraint=call.constraint
    )
    return await _chat_body(service, call, run, merged)


async def _chat_completions(
    service: GenerationService, body: ChatRequest
) -> JSONResponse | EventStream:
    call = prepare_chat(service, body)
    num_top = call.num_top
    run = Run(service, body, "/v1/chat/completions", "interactive")
    merged = await prime(
        run.start(
            [call.prompt] * body.n,
            [call.max_tokens] * body.n,
            num_top,
            announce=bool(body.stream),
            constraint=call.constraint,
        )
    )
    tokenizer = service.tokenizer

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": run.id,
            "object": "chat.completion.chunk",
            "created": run.created,
            "model": body.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if body.stream_options and body.stream_options.include_usage:
            data["usage"] = usage
        return sse_event(data)

    if body.stream:

        async def events() -> AsyncIterator[bytes]:
            # With tools, content stays null until text comes (a reply of calls alone has none).
            first = {"role": "assistant", "content": None if call.tools else ""}
            readers = [ToolDeltas() for _ in range(body.n)] if call.tools else None
            for i in range(body.n):
                yield chunk([{"index": i, "delta": first, "logprobs": None, "finish_reason": None}])
            async with contextlib.aclosing(merged):  # type: ignore[type-var]
                try:
                    async for i, d in merged:
                        if not d.token_ids and d.finish_reason is None:
                            continue  # the engine has it: nothing to send yet
                        run.count(i, d)
                        lp = (
                            {"content": _chat_logprobs(tokenizer, d.logprobs)}
                            if num_top is not None
                            else None
                        )
                        reason = (
                            FINISH_REASONS.get(d.finish_reason or "") if d.finish_reason else None
                        )
                        if readers is None:
                            deltas = [{"content": d.text}] if d.text or lp else []
                        else:
                            deltas = readers[i].feed(d.text)
                            if reason:
                                last, reason = readers[i].finish(reason)
                                deltas += last
                            deltas = deltas or ([{}] if lp else [])
                        for k, delta in enumerate(deltas):
                            yield chunk([_delta_choice(i, delta, lp if k == 0 else None)])
                        if reason:
                            yield chunk([_delta_choice(i, {}, None, reason)])
                except APIError as exc:
                    yield sse_event(openai_error_body(exc.kind, exc.message, exc.param))
                    return
            if body.stream_options and body.stream_options.include_usage:
                yield chunk([], run.usage())
            yield sse_event("[DONE]")

        return EventStream(events())

    return JSONResponse(await _chat_body(service, call, run, merged))


async def _chat_body(
    service: GenerationService,
    call: ChatCall,
    run: Run,
    merged: AsyncIterator[tuple[int, TextDelta]],
) -> dict[str, Any]:
    body, n = call.body, call.body.n
    texts = [""] * n
    logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    reasons = ["stop"] * n
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        async for i, d in merged:
            texts[i] += d.text
            logprobs[i] += _chat_logprobs(service.tokenizer, d.logprobs)
            run.count(i, d)
            if d.finish_reason:
                reasons[i] = FINISH_REASONS.get(d.finish_reason, "stop")
    choices = []
    for i in range(n):
        message: dict[str, Any] = {"role": "assistant", "content": texts[i], "refusal": None}
        if call.tools:  # the output read back as text and calls, as a stream reads it
            reader = ToolDeltas()
            reader.feed(texts[i])
            reasons[i] = reader.finish(reasons[i])[1]
            message = reader.message()
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": {"content": logprobs[i]} if call.num_top is not None else None,
                "finish_reason": reasons[i],
            }
        )
    return {
        "id": run.id,
        "object": "chat.completion",
        "created": run.created,
        "model": body.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": run.usage(),
    }


def _delta_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, reason: str | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
