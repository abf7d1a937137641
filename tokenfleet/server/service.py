"""What both APIs share: prompts to token ids, validation, admission, and a stream of text
deltas (detokenized, stop strings applied) for one engine request."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from tokenfleet.detokenizer import IncrementalDetokenizer, StopChecker
from tokenfleet.engine_client import AsyncEngineClient, EngineDeadError
from tokenfleet.errors import InvalidRequestError
from tokenfleet.outputs import EngineCoreRequest, TokenLogprobs
from tokenfleet.sampling_params import SamplingParams
from tokenfleet.server.errors import APIError
from tokenfleet.server.metrics import Metrics
from tokenfleet.server.settings import ServeConfig
from tokenfleet.tokenizer import Tokenizer

T = TypeVar("T")

# Priority classes as the engine's scheduler orders them (lower first).
PRIORITIES = {"interactive": 0, "batch": 1}


class ClientDisconnected(Exception):
    """The caller went away before its non-streamed reply was ready."""


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work` (collecting a non-streamed reply) unless the client disconnects first:
    then cancel it, which closes its generation and so aborts the engine request, and
    raise ClientDisconnected. (A streamed reply needs none of this: Starlette stops the
    stream, and closing it aborts the request.)"""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its abort go out
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read: what the server sends next is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class TextDelta:
    """What one engine step added to one request, ready for the wire.

    finish_reason: None while running; "stop" (EOS or a stop token), "length",
    "stop_sequence" (a stop string; `stop_sequence` says which) or "abort".
    """

    text: str
    token_ids: list[int]
    num_output_tokens: int  # cumulative
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None


class GenerationService:
    def __init__(
        self, client: AsyncEngineClient, tokenizer: Tokenizer, config: ServeConfig, metrics: Metrics
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self._pending_prefill_tokens = 0
        self._prefill_tokens_per_s = config.initial_prefill_tokens_per_s

    @property
    def max_model_len(self) -> int:
        info = self.client.info
        if info is None:
            raise APIError(503, "engine_down", "the engine is starting; try again shortly")
        return info.max_model_len

    def check_model(self, model: str) -> None:
        if model != self.config.served_model_name:
            raise APIError(
                404,
                "not_found",
                f"model {model!r} not found; this server serves {self.config.served_model_name!r}",
                param="model",
            )

    def render_chat(
        self, messages: list[dict[str, Any]], *, continue_final: bool = False
    ) -> list[int]:
        """Token ids of a conversation; a final assistant turn is continued, not closed."""
        prefix = ""
        if continue_final and messages and messages[-1]["role"] == "assistant":
            prefix = messages[-1]["content"]
            messages = messages[:-1]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text + prefix)

    def check_length(self, num_prompt_tokens: int, max_tokens: int, param: str) -> None:
        limit = self.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                "invalid_request",
                f"prompt ({num_prompt_tokens} tokens) plus {param} ({max_tokens}) is "
                f"{num_prompt_tokens + max_tokens} tokens, over the context length of {limit}",
                param=param,
            )

    def admit(self, num_prompt_tokens: int) -> None:
        """Refuse at once what could not get its first token within the TTFT target."""
        if not self.client.is_healthy():
            raise APIError(503, "engine_down", "the engine is not running; try again shortly")
        predicted = (self._pending_prefill_tokens + num_prompt_tokens) / self._prefill_tokens_per_s
        if predicted > self.config.ttft_target_s:
            raise APIError(
                529,
                "overloaded",
                f"overloaded: the predicted time to first token ({predicted:.2f} s) exceeds "
                f"the target ({self.config.ttft_target_s:.2f} s); retry later",
                retry_after_s=max(1, round(predicted - self.config.ttft_target_s)),
            )

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop: Sequence[str] = (),
        *,
        route: str,
        priority: str = "interactive",
    ) -> AsyncGenerator[TextDelta, None]:
        num_prompt = len(prompt_token_ids)
        request = EngineCoreRequest(
            f"gen-{uuid.uuid4().hex}",
            prompt_token_ids,
            params,
            time.monotonic(),
            priority=PRIORITIES[priority],
        )
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        stopper = StopChecker(list(stop))
        labels = {"route": route, "priority": priority}
        start = last = time.monotonic()
        waiting_first = True
        num_output = 0
        self._pending_prefill_tokens += num_prompt
        self.metrics.prompt_tokens.inc(num_prompt)
        try:
            async with contextlib.aclosing(self.client.generate(request)) as outputs:
                async for out in outputs:
                    now = time.monotonic()
                    if waiting_first:
                        waiting_first = False
                        self._pending_prefill_tokens -= num_prompt
                        self._observe_first_token(num_prompt, now - start)
                        self.metrics.ttft.labels(**labels).observe(now - start)
                    elif out.new_token_ids:
                        self.metrics.tpot.labels(**labels).observe(now - last)
                    last = now
                    num_output += len(out.new_token_ids)
                    self.metrics.generation_tokens.inc(len(out.new_token_ids))
                    shown = out.new_token_ids
                    if out.stop_token_id is not None:
                        shown = shown[:-1]
                    text, matched = stopper.feed(detok.add_tokens(shown))
                    delta = TextDelta(text, out.new_token_ids, num_output, out.logprobs or [])
                    if matched is not None:
                        delta.finish_reason, delta.stop_sequence = "stop_sequence", matched
                    elif out.finished:
                        tail, matched = stopper.feed(detok.flush())
                        delta.text += tail
                        if matched is not None:
                            delta.finish_reason, delta.stop_sequence = "stop_sequence", matched
                        else:
                            delta.text += stopper.flush()
                            delta.finish_reason = out.finish_reason
                    yield delta
                    if delta.finish_reason is not None:
                        self.metrics.e2e.labels(**labels).observe(time.monotonic() - start)
                        return
        except EngineDeadError as exc:
            raise APIError(503, "engine_down", str(exc)) from exc
        except InvalidRequestError as exc:
            raise APIError(400, "invalid_request", exc.message, param=exc.param) from exc
        finally:
            if waiting_first:
                self._pending_prefill_tokens -= num_prompt

    def _observe_first_token(self, num_prompt: int, seconds: float) -> None:
        # An exponential moving average of the engine's prefill speed, as seen from here.
        if seconds > 0 and num_prompt >= 32:
            rate = num_prompt / seconds
            self._prefill_tokens_per_s = 0.8 * self._prefill_tokens_per_s + 0.2 * rate
