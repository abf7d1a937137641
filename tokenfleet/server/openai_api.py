"""OpenAI Chat Completions and Completions: the request models and the machinery both
routes share (sampling params, merging the choices' streams, one call's accounting); the
routes are in openai_chat.py and openai_completions.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server.body import read_body
from tokenfleet.server.errors import APIError
from tokenfleet.server.ids import random_hex
from tokenfleet.server.service import (
    ClientDisconnected,
    GenerationService,
    TextDelta,
    cancel_on_disconnect,
)
from tokenfleet.server.unsupported import text_blocks

R = TypeVar("R", bound="CommonRequest")

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


class CommonRequest(BaseModel):
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
    ignore_eos: bool = False  # vLLM's extras, served: ignore_eos, top_k, stop_token_ids
    stop_token_ids: list[int] | None = None
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

    def check_stream_options(self) -> None:
        """stream_options go with stream only (OpenAI refuses them on a plain reply)."""
        if self.stream_options is not None and not self.stream:
            message = "The 'stream_options' parameter is only allowed when 'stream' is enabled."
            raise APIError(400, "invalid_request", message, param="stream_options")

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
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)  # 0: with echo, the prompt scored and nothing more
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt before the completion (with logprobs: its logprobs too)


def sampling_params(
    body: CommonRequest, max_tokens: int, logprobs: int | None, index: int, prompt_logprobs: bool
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=None if body.seed is None else body.seed + index,
            ignore_eos=body.ignore_eos,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
            prompt_logprobs=logprobs if prompt_logprobs else None,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=tuple((body.logit_bias or {}).items()),
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
                sampling_params(self.body, m, logprobs, i % self.body.n, self.echo),
                stop,
                route=self.route,
                priority=self.priority,
                announce=announce,
                predicted=verdict,
            )
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
        ]
        return merge(streams)

    def usage(self) -> dict[str, int]:
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
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
