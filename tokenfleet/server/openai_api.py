"""OpenAI Chat Completions and Completions: POST /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from tokenfleet.errors import InvalidRequestError
from tokenfleet.outputs import TokenLogprobs
from tokenfleet.sampling_params import SamplingParams
from tokenfleet.server.body import read_body
from tokenfleet.server.errors import APIError, openai_error_body
from tokenfleet.server.ids import random_hex
from tokenfleet.server.service import (
    ClientDisconnected,
    GenerationService,
    TextDelta,
    cancel_on_disconnect,
)
from tokenfleet.server.sse import EventStream, prime, sse_event
from tokenfleet.server.unsupported import (
    OPENAI_CHAT,
    OPENAI_COMPLETION,
    OPENAI_MESSAGE,
    refuse_unsupported,
    text_blocks,
)
from tokenfleet.tokenizer import Tokenizer

router = APIRouter()

FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "abort": "stop"}


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    _text_only = field_validator("content", mode="before")(text_blocks)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # token id -> bias (JSON object keys are strings; pydantic reads them as ints)
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise APIError(400, "invalid_request", "stop: at most 4 sequences", param="stop")
        return stop

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key in value:
                if not (isinstance(key, str) and key.isdigit()):
                    raise PydanticCustomError(
                        "token_id", "key {key} is not a token id", {"key": repr(key)}
                    )
        return value

    def check_logit_bias(self, vocab: int) -> None:
        bad = next((t for t in self.logit_bias or {} if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400,
                "invalid_request",
                f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})",
                param="logit_bias",
            )


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt before the completion (with logprobs: its logprobs too)


def _params(
    body: _Common, max_tokens: int, logprobs: int | None, index: int, prompt_logprobs: bool
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=None if body.seed is None else body.seed + index,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=logprobs if prompt_logprobs else None,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=tuple((body.logit_bias or {}).items()),
        )
    except InvalidRequestError as exc:
        raise APIError(400, "invalid_request", exc.message, param=exc.param) from exc


async def _merge(
    streams: list[AsyncIterator[TextDelta]],
) -> AsyncGenerator[tuple[int, TextDelta], None]:
    """Interleave several choices' streams; closing the merge closes (aborts) them all."""
    if len(streams) == 1:  # the common case: no pump task and queue per token
        async with contextlib.aclosing(streams[0]):  # type: ignore[type-var]
            async for delta in streams[0]:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, TextDelta | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[TextDelta]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for delta in stream:
                    await queue.put((index, delta))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
        for e in entries
    ]


def _completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs], offset: int
) -> dict[str, Any]:
    tokens = [_token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


class _Run:
    """One API call: its prompts (one per choice), the merged stream and the accounting.
    Interactive calls pass admission control; batch calls are never refused for load."""

    def __init__(
        self, service: GenerationService, body: _Common, route: str, priority: str
    ) -> None:
        self.service, self.body, self.route, self.priority = service, body, route, priority
        self.id = ("chatcmpl-" if route.endswith("chat/completions") else "cmpl-") + random_hex(32)
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.completion_tokens = [0]
        # The prompt's logprobs too, where its echo shows them.
        self.echo = isinstance(body, CompletionRequest) and body.echo

    def start(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        logprobs: int | None,
        *,
        announce: bool = False,
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """The choices' merged deltas; with `announce` (streams), each choice's first is
        empty, sent once the engine has it (GenerationService.generate): skip those."""
        self.prompt_tokens = sum(len(p) for p in prompts[:: self.body.n])
        self.completion_tokens = [0] * len(prompts)
        stop = self.body.stop_list()
        verdict = None
        if self.priority == "interactive":
            verdict = self.service.admit(sum(len(p) for p in prompts[:: self.body.n]))
        streams = [
            self.service.generate(
                p,
                _params(self.body, m, logprobs, i % self.body.n, self.echo),
                stop,
                route=self.route,
                priority=self.priority,
                announce=announce,
                predicted=verdict,
            )
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
        ]
        return _merge(streams)

    def usage(self) -> dict[str, int]:
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """A non-streamed reply's work, cancelled (and its requests aborted) on a disconnect."""
    try:
        return await cancel_on_disconnect(request, work)
    except ClientDisconnected:
        return Response(status_code=499)  # client closed request; no one reads it


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    service: GenerationService = request.app.state.service
    body = await read_body(request, ChatRequest)
    if body.stream:  # set up at once; from then on the stream itself stops on a disconnect
        return await _chat_completions(service, body)
    return await _unless_disconnected(request, _chat_completions(service, body))


@dataclass
class ChatCall:
    """A validated chat completion call: what it sent, and its prompt's token ids."""

    body: ChatRequest
    prompt: list[int]
    max_tokens: int
    num_top: int | None  # top logprobs per token; None: no logprobs


def prepare_chat(service: GenerationService, body: ChatRequest) -> ChatCall:
    """Every check of a chat completion call that needs no engine time."""
    service.check_model(body.model)
    body.stop_list()
    refuse_unsupported(body, OPENAI_CHAT)
    for i, m in enumerate(body.messages):
        refuse_unsupported(m, OPENAI_MESSAGE, f"messages.{i}.")
    body.check_logit_bias(service.vocab_size)
    messages = []
    for m in body.messages:
        content = (
            m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        )
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    prompt = service.render_chat(messages)
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = max(service.max_model_len - len(prompt), 1)
    service.check_length(len(prompt), max_tokens, param)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    return ChatCall(body, prompt, max_tokens, num_top)


async def run_chat(service: GenerationService, call: ChatCall, priority: str) -> dict[str, Any]:
    """A non-streamed chat completion, as its JSON body (the Batch API's path)."""
    run = _Run(service, call.body, "/v1/chat/completions", priority)
    merged = run.start([call.prompt] * call.body.n, [call.max_tokens] * call.body.n, call.num_top)
    return await _chat_body(service, call, run, merged)


async def _chat_completions(
    service: GenerationService, body: ChatRequest
) -> JSONResponse | EventStream:
    call = prepare_chat(service, body)
    num_top = call.num_top
    run = _Run(service, body, "/v1/chat/completions", "interactive")
    merged = await prime(
        run.start(
            [call.prompt] * body.n, [call.max_tokens] * body.n, num_top, announce=bool(body.stream)
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
            for i in range(body.n):
                delta = {"role": "assistant", "content": ""}
                yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            async with contextlib.aclosing(merged):  # type: ignore[type-var]
                try:
                    async for i, d in merged:
                        if not d.token_ids and d.finish_reason is None:
                            continue  # the engine has it: nothing to send yet
                        run.completion_tokens[i] = d.num_output_tokens
                        lp = (
                            {"content": _chat_logprobs(tokenizer, d.logprobs)}
                            if num_top is not None
                            else None
                        )
                        reason = (
                            FINISH_REASONS.get(d.finish_reason or "") if d.finish_reason else None
                        )
                        if d.text or lp:
                            choice = {
                                "index": i,
                                "delta": {"content": d.text},
                                "logprobs": lp,
                                "finish_reason": None,
                            }
                            yield chunk([choice])
                        if reason:
                            yield chunk(
                                [
                                    {
                                        "index": i,
                                        "delta": {},
                                        "logprobs": None,
                                        "finish_reason": reason,
                                    }
                                ]
                            )
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
    run: _Run,
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
            run.completion_tokens[i] = d.num_output_tokens
            if d.finish_reason:
                reasons[i] = FINISH_REASONS.get(d.finish_reason, "stop")
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": texts[i], "refusal": None},
            "logprobs": {"content": logprobs[i]} if call.num_top is not None else None,
            "finish_reason": reasons[i],
        }
        for i in range(n)
    ]
    return {
        "id": run.id,
        "object": "chat.completion",
        "created": run.created,
        "model": body.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": run.usage(),
    }


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    service: GenerationService = request.app.state.service
    body = await read_body(request, CompletionRequest)
    if body.stream:  # set up at once; from then on the stream itself stops on a disconnect
        return await _completions(service, body)
    return await _unless_disconnected(request, _completions(service, body))


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
    refuse_unsupported(body, OPENAI_COMPLETION)
    best_of = (body.model_extra or {}).get("best_of")
    if best_of is not None and best_of not in (1, body.n):
        message = "best_of: only best_of equal to n is supported"
        raise APIError(400, "invalid_request", message, param="best_of")
    body.check_logit_bias(service.vocab_size)
    raw = body.prompt
    tokenizer = service.tokenizer
    sent: list[str | list[int]]
    if isinstance(raw, str) or (raw and all(isinstance(p, int) for p in raw)):
        sent = [raw]  # type: ignore[list-item]
    else:
        sent = list(raw)  # type: ignore[arg-type]
    prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in sent]
    if not prompts or any(not p for p in prompts):
        raise APIError(400, "invalid_request", "prompt must not be empty", param="prompt")
    vocab = service.vocab_size
    for p in prompts:
        if any(not 0 <= t < vocab for t in p):
            raise APIError(
                400, "invalid_request", f"prompt token ids must be in [0, {vocab})", param="prompt"
            )
        service.check_length(len(p), body.max_tokens, "max_tokens")
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
    body, expanded = call.body, call.prompts
    run = _Run(service, body, "/v1/completions", priority)
    merged = run.start(expanded, [body.max_tokens] * len(expanded), body.logprobs)
    return await _completion_body(service, call, run, merged)


async def _completions(
    service: GenerationService, body: CompletionRequest
) -> JSONResponse | EventStream:
    call = prepare_completion(service, body)
    expanded = call.prompts
    run = _Run(service, body, "/v1/completions", "interactive")
    merged = await prime(
        run.start(
            expanded, [body.max_tokens] * len(expanded), body.logprobs, announce=bool(body.stream)
        )
    )
    render = _CompletionChoices(service.tokenizer, call, run)

    if body.stream:

        async def events() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(merged):  # type: ignore[type-var]
                try:
                    async for i, d in merged:
                        run.completion_tokens[i] = d.num_output_tokens
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

    def __init__(self, tokenizer: Tokenizer, call: CompletionCall, run: _Run) -> None:
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
        first = _token_text(self.tokenizer, self.call.prompts[i][0])
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
    run: _Run,
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
            run.completion_tokens[i] = d.num_output_tokens
            last[i] = d
    choices = []
    for i, final in enumerate(last):
        assert final is not None
        whole = TextDelta(texts[i], [], final.num_output_tokens, entries[i], final.finish_reason)
        whole.prompt_logprobs = prompt_entries[i]
        choices.append(render.choice(i, whole, texts[i]))
    return render.data(choices, run.usage())
