"""OpenAI Completions (legacy): POST /v1/completions (JSON or SSE chunks), echo included."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.core.engine_api import TokenLogprobs
from tokenfleet.server.bounds import check_engine_requests
from tokenfleet.server.errors import APIError, openai_error_body
from tokenfleet.server.openai_api import (
    FINISH_REASONS,
    CompletionRequest,
    Run,
    reply,
    token_text,
)
from tokenfleet.server.schemas import request_body
from tokenfleet.server.service import GenerationService, TextDelta
from tokenfleet.server.sse import EventStream, prime, sse_event
from tokenfleet.server.unsupported import OPENAI_COMPLETION, refuse_unsupported

router = APIRouter()


def _completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs], offset: int
) -> dict[str, Any]:
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


@router.post("/v1/completions", response_model=None, openapi_extra=request_body(CompletionRequest))
async def completions(request: Request) -> Response:
    return await reply(request, CompletionRequest, _completions)


@dataclass
class CompletionCall:
    """A validated completions call: one prompt's token ids per choice (prompt x n), and
    with echo its text (as sent, or decoded from token ids; else empty)."""

    body: CompletionRequest
    prompts: list[list[int]]
    texts: list[str]


def prepare_completion(service: GenerationService, body: CompletionRequest) -> CompletionCall:
    """Every check of a completions call that needs no engine time."""
    service.check_model(body.model)
    body.stop_list()
    body.check_stream_options()
    refuse_unsupported(body, OPENAI_COMPLETION)
    best_of = (body.model_extra or {}).get("best_of")
    if best_of is not None and best_of not in (1, body.n):
        message = "best_of: only best_of equal to n is supported"
        raise APIError(400, "invalid_request", message, param="best_of")
    body.check_bounds(service.vocab_size)
    if body.max_tokens == 0 and not body.echo:
        message = "max_tokens: 0 only with echo (the prompt scored, nothing generated)"
        raise APIError(400, "invalid_request", message, param="max_tokens")
    raw = body.prompt
    tokenizer = service.tokenizer
    sent: list[str | list[int]]
    if isinstance(raw, str) or (raw and all(isinstance(p, int) for p in raw)):
        sent = [raw]  # type: ignore[list-item]
    else:
        sent = list(raw)  # type: ignore[arg-type]
    check_engine_requests(
        len(sent) * body.n, service.config.max_engine_requests_per_request, "prompt"
    )
    prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in sent]
    if not prompts or any(not p for p in prompts):
        raise APIError(400, "invalid_request", "prompt must not be empty", param="prompt")
    vocab = service.vocab_size
    for p in prompts:
        if any(not 0 <= t < vocab for t in p):
            raise APIError(
                400, "invalid_request", f"prompt token ids must be in [0, {vocab})", param="prompt"
            )
        service.check_length(len(p), max(body.max_tokens, 1), "max_tokens")
    texts = [""] * len(sent)
    if body.echo:
        texts = [
            p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)
            for p in sent
        ]
    n = body.n
    return CompletionCall(
        body, [p for p in prompts for _ in range(n)], [t for t in texts for _ in range(n)]
    )


async def run_completion(
    service: GenerationService, call: CompletionCall, priority: str
) -> dict[str, Any]:
    """A non-streamed completion, as its JSON body (the Batch API's path)."""
    run = Run(service, call.body, "/v1/completions", priority)
    return await _completion_body(service, call, run, _start(call, run))


def _start(
    call: CompletionCall, run: Run, *, announce: bool = False
) -> AsyncIterator[tuple[int, TextDelta]]:
    """The choices' merged deltas. For max_tokens 0 (echo: scoring the prompt) the engine
    is asked for one token, and none of it is shown."""
    body, prompts = call.body, call.prompts
    most = [max(body.max_tokens, 1)] * len(prompts)
    merged = run.start(prompts, most, body.logprobs, announce=announce)
    return merged if body.max_tokens else _prompt_only(merged)


async def _prompt_only(
    merged: AsyncIterator[tuple[int, TextDelta]],
) -> AsyncGenerator[tuple[int, TextDelta], None]:
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        async for i, d in merged:
            reason = "length" if d.finish_reason else None
            yield i, TextDelta("", [], 0, [], reason, prompt_logprobs=d.prompt_logprobs)


async def _completions(
    service: GenerationService, body: CompletionRequest
) -> JSONResponse | EventStream:
    call = prepare_completion(service, body)
    run = Run(service, body, "/v1/completions", "interactive")
    merged = await prime(_start(call, run, announce=bool(body.stream)))
    render = _CompletionChoices(service.tokenizer, call, run)

    if body.stream:

        async def events() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(merged):  # type: ignore[type-var]
                try:
                    async for i, d in merged:
                        run.count(i, d)
                        # Tokens whose text is held back (a partial character or stop
                        # string) still carry their logprobs.
                        if d.text or d.finish_reason or (body.logprobs is not None and d.logprobs):
                            yield sse_event(render.data([render.choice(i, d, d.text)]))
                except APIError as exc:
                    yield sse_event(openai_error_body(exc.kind, exc.message, exc.param))
                    return
            if body.stream_options and body.stream_options.include_usage:
                yield sse_event(render.data([], run.usage()))
            yield sse_event("[DONE]")

        return EventStream(events())

    return JSONResponse(await _completion_body(service, call, run, merged))


class _CompletionChoices:
    """Renders text_completion objects and their choices (logprob offsets carry on). With
    echo, a choice's first rendering starts with its prompt (and the prompt's logprobs:
    none for its first token)."""

    def __init__(self, tokenizer: Tokenizer, call: CompletionCall, run: Run) -> None:
        self.tokenizer, self.call, self.body, self.run = tokenizer, call, call.body, run
        self.offsets = [len(t) for t in call.texts]  # (empty but with echo)
        self.to_echo = set(range(len(call.prompts))) if call.body.echo else set()

    def choice(self, i: int, d: TextDelta, text: str) -> dict[str, Any]:
        lp = None
        echo = i in self.to_echo
        self.to_echo.discard(i)
        if self.body.logprobs is not None:
            lp = _completion_logprobs(self.tokenizer, d.logprobs, self.offsets[i])
            if lp["tokens"]:  # a stream's next chunk goes on from the last token's end
                self.offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if echo:
                lp = self._with_prompt(i, d.prompt_logprobs or [], lp)
        if echo:
            text = self.call.texts[i] + text
        reason = FINISH_REASONS.get(d.finish_reason, "stop") if d.finish_reason else None
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

    def _with_prompt(
        self, i: int, entries: list[TokenLogprobs], completion: dict[str, Any]
    ) -> dict[str, Any]:
        """The prompt's tokens, logprobs and offsets (from 0), then the completion's."""
        prompt = _completion_logprobs(self.tokenizer, entries, 0)
        first = token_text(self.tokenizer, self.call.prompts[i][0])
        offsets = [0] + [o + len(first) for o in prompt["text_offset"]]
        return {
            "tokens": [first, *prompt["tokens"], *completion["tokens"]],
            "token_logprobs": [None, *prompt["token_logprobs"], *completion["token_logprobs"]],
            "top_logprobs": [None, *prompt["top_logprobs"], *completion["top_logprobs"]],
            "text_offset": offsets + completion["text_offset"],
        }

    def data(
        self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        body = self.body
        out: dict[str, Any] = {
            "id": self.run.id,
            "object": "text_completion",
            "created": self.run.created,
            "model": body.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if usage is not None or not body.stream:
            out["usage"] = usage
        elif body.stream_options and body.stream_options.include_usage:
            out["usage"] = None
        return out


async def _completion_body(
    service: GenerationService,
    call: CompletionCall,
    run: Run,
    merged: AsyncIterator[tuple[int, TextDelta]],
) -> dict[str, Any]:
    expanded = call.prompts
    render = _CompletionChoices(service.tokenizer, call, run)
    texts = [""] * len(expanded)
    entries: list[list[TokenLogprobs]] = [[] for _ in expanded]
    prompt_entries: list[list[TokenLogprobs] | None] = [None] * len(expanded)
    last: list[TextDelta | None] = [None] * len(expanded)
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        async for i, d in merged:
            texts[i] += d.text
            entries[i] += d.logprobs
            if d.prompt_logprobs is not None:
                prompt_entries[i] = d.prompt_logprobs
            run.count(i, d)
            last[i] = d
    choices = []
    for i, final in enumerate(last):
        assert final is not None
        whole = TextDelta(texts[i], [], final.num_output_tokens, entries[i], final.finish_reason)
        whole.prompt_logprobs = prompt_entries[i]
        choices.append(render.choice(i, whole, texts[i]))
    return render.data(choices, run.usage())
