"""OpenAI Chat Completions and Completions: the request models and the machinery both
routes share (sampling params, merging the choices' streams, one call's accounting); the
routes are in openai_chat.py and openai_completions.py."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.core.sampling_params import Constraint, SamplingParams
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server.body import read_body
from tokenfleet.server.bounds import (
    JSON_INT_MAX,
    MAX_CONTENT_BLOCKS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPT_TOKEN_IDS,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES_OPENAI,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_MAX,
    MAX_TOOL_ID_CHARS,
    SEED_MAX,
    SEED_MIN,
    TOP_K_MAX,
    check_seed,
    clamp_temperature,
    clamp_top_k,
    clamp_top_p,
)
from tokenfleet.server.errors import APIError
from tokenfleet.server.ids import random_hex
from tokenfleet.server.openai_tools import FunctionTool, ToolCallParams, ToolChoiceParam
from tokenfleet.server.schemas import drop_nulls, nullable_fields
from tokenfleet.server.service import (
    ClientDisconnected,
    GenerationService,
    TextDelta,
    cancel_on_disconnect,
)
from tokenfleet.server.structured import ResponseFormat
from tokenfleet.server.unsupported import text_blocks

R = TypeVar("R", bound="CommonRequest")

FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "abort": "stop"}


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=JSON_INT_MAX)]  # and within the vocabulary, checked later


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_BLOCKS)] | None = None
    tool_calls: ToolCallParams | None = None  # an assistant's (openai_tools.py)
    tool_call_id: str | None = Field(None, max_length=MAX_TOOL_ID_CHARS)  # a tool result's

    _text_only = field_validator("content", mode="before")(text_blocks)


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields OpenAI accepts as null, read as left out (their defaults): schemas.drop_nulls.
_NULLABLE = (
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "max_tokens",
    "echo",
    "parallel_tool_calls",
)


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=nullable_fields)
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = _NULLABLE

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=TOP_K_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: (
        StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES_OPENAI)] | None
    ) = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extras, served: ignore_eos, top_k, stop_token_ids
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # token id -> bias (JSON object keys are strings; pydantic reads them as ints)
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )

    _nulls = model_validator(mode="before")(drop_nulls)

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

    def check_stream_options(self) -> None:
        """stream_options go with stream only (OpenAI refuses them on a plain reply)."""
        if self.stream_options is not None and not self.stream:
            message = "The 'stream_options' parameter is only allowed when 'stream' is enabled."
            raise APIError(400, "invalid_request", message, param="stream_options")

    def check_bounds(self, vocab: int) -> None:
        """What needs the model: token ids within its vocabulary, top_k past it as off
        (0), and seed + i a 64-bit seed for every choice i of n."""
        check_seed(self.seed, self.n)
        self.top_k = clamp_top_k(self.top_k, vocab)
        self.check_token_ids(vocab)

    def check_token_ids(self, vocab: int) -> None:
        """logit_bias and stop_token_ids name tokens of the vocabulary."""
        for param, ids in (
            ("logit_bias", self.logit_bias),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = next((t for t in ids or () if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(
                    400,
                    "invalid_request",
                    f"{param}: token id {bad} is outside the vocabulary [0, {vocab})",
                    param=param,
                )


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    response_format: ResponseFormat | None = None
    tools: list[FunctionTool] | None = None  # checked by openai_tools.chat_tools
    tool_choice: ToolChoiceParam | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(CommonRequest):
    prompt: (
        str
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)]
        | Annotated[
            list[Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)]],
            Field(max_length=MAX_PROMPTS),
        ]
    )
    # 0: with echo, the prompt scored and nothing more
    max_tokens: int = Field(16, ge=0, le=MAX_TOKENS_MAX)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt before the completion (with logprobs: its logprobs too)


def sampling_params(
    body: CommonRequest,
    max_tokens: int,
    logprobs: int | None,
    index: int,
    prompt_logprobs: bool,
    constraint: Constraint | None = None,
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=clamp_temperature(body.temperature),
            top_p=clamp_top_p(body.top_p),
            top_k=body.top_k,
            seed=None if body.seed is None else body.seed + index,
            ignore_eos=body.ignore_eos,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
            prompt_logprobs=logprobs if prompt_logprobs else None,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=tuple((body.logit_bias or {}).items()),
            constraint=constraint,
        )
    except InvalidRequestError as exc:
        raise APIError(400, "invalid_request", exc.message, param=exc.param) from exc


async def merge(
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


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) character for each byte, reversed: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def token_bytes(tokenizer: Tokenizer, token_id: int, text: str | None = None) -> list[int]:
    """A token's own UTF-8 bytes (chat logprobs' `bytes`): for a token that is only part
    of a multi-byte character, its part, not the replacement character its text shows."""
    text = token_text(tokenizer, token_id) if text is None else text
    if "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return list(text.encode())
    match = _BYTE_FALLBACK.fullmatch(piece)
    if match:
        return [int(match[1], 16)]
    if all(c in _BYTE_OF_CHAR for c in piece):
        return [_BYTE_OF_CHAR[c] for c in piece]
    return list(text.encode())


class Run:
    """One API call: its prompts (one per choice), the merged stream and the accounting.
    Interactive calls pass admission control; batch calls are never refused for load."""

    def __init__(
        self, service: GenerationService, body: CommonRequest, route: str, priority: str
    ) -> None:
        self.service, self.body, self.route, self.priority = service, body, route, priority
        self.id = ("chatcmpl-" if route.endswith("chat/completions") else "cmpl-") + random_hex(32)
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.completion_tokens = [0]
        self.cached_tokens = [0]  # prompt tokens each choice found in the prefix cache
        # The prompt's logprobs too, where its echo shows them.
        self.echo = isinstance(body, CompletionRequest) and body.echo

    def start(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        logprobs: int | None,
        *,
        announce: bool = False,
        constraint: Constraint | None = None,
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """The choices' merged deltas; with `announce` (streams), each choice's first is
        empty, sent once the engine has it (GenerationService.generate): skip those.
        `constraint`: what every choice's output must match (structured output, tools)."""
        self.prompt_tokens = sum(len(p) for p in prompts[:: self.body.n])
        self.completion_tokens = [0] * len(prompts)
        self.cached_tokens = [0] * len(prompts)
        stop = self.body.stop_list()
        verdict = None
        if self.priority == "interactive":
            verdict = self.service.admit(sum(len(p) for p in prompts[:: self.body.n]))
        streams = [
            self.service.generate(
                p,
                sampling_params(self.body, m, logprobs, i % self.body.n, self.echo, constraint),
                stop,
                route=self.route,
                priority=self.priority,
                announce=announce,
                predicted=verdict,
            )
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
        ]
        return merge(streams)

    def count(self, index: int, delta: TextDelta) -> None:
        """A choice's tokens so far, for usage."""
        self.completion_tokens[index] = delta.num_output_tokens
        self.cached_tokens[index] = delta.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        """Usage as OpenAI reports it: each prompt counted once (its first choice's),
        `prompt_tokens_details.cached_tokens` the part of them read from the prefix cache."""
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens[:: self.body.n])},
        }


async def reply(
    request: Request,
    model: type[R],
    handler: Callable[[GenerationService, R], Coroutine[Any, Any, Response]],
) -> Response:
    """A route's reply: the body read and checked against `model`, then `handler`'s. A
    stream is set up at once (from then on it stops by itself on a disconnect); a JSON
    reply's work is cancelled on one."""
    service: GenerationService = request.app.state.service
    body = await read_body(request, model)
    if body.stream:
        return await handler(service, body)
    return await unless_disconnected(request, handler(service, body))


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """A non-streamed reply's work, cancelled (and its requests aborted) on a disconnect."""
    try:
        return await cancel_on_disconnect(request, work)
    except ClientDisconnected:
        return Response(status_code=499)  # client closed request; no one reads it
