"""Checking and tokenizing large bodies off the event loop.

Tokenizing a few megabytes takes seconds; on the event loop it would stall every other
caller. For a generation route's body over `offload_body_bytes`, the gateway reads the
body, then runs the route's own checks (JSON, the request model, the chat template, the
tokenizer) in a bounded thread pool; a 4xx found there is the reply. The route then runs
as usual on the replayed body, and its tokenizer calls are answered from what the pool
computed (GatewayTokenizer), so that only cheap work is left on the loop.

The tokenizer releases the GIL while it runs (encode_batch_fast: the same ids as encode,
without character offsets), so the loop goes on meanwhile.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

import msgspec
from starlette.types import Message, Receive

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.server import anthropic_api, openai_chat, openai_completions
from tokenfleet.server.anthropic_api import CountTokensRequest, MessagesRequest
from tokenfleet.server.body import parse_body
from tokenfleet.server.errors import APIError
from tokenfleet.server.openai_api import ChatRequest, CompletionRequest
from tokenfleet.server.service import GenerationService

# text, add_special_tokens -> token ids: recorded by a pre-check in the pool, replayed
# (each entry once) by the route on the loop.
_Memo = dict[tuple[str, bool], list[int]]
_RECORD: ContextVar[_Memo | None] = ContextVar("tokenfleet_tokens_record", default=None)
_REPLAY: ContextVar[_Memo | None] = ContextVar("tokenfleet_tokens_replay", default=None)


class GatewayTokenizer(Tokenizer):
    """The gateway's tokenizer: encode without offsets (the GIL released while it runs),
    and from the request's pre-check where it already tokenized the same text."""

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        key = (text, add_special_tokens)
        replay = _REPLAY.get()
        if replay is not None:
            ids = replay.pop(key, None)
            if ids is not None:
                return ids
        encoding = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        ids = list(encoding[0].ids)
        record = _RECORD.get()
        if record is not None:
            record[key] = ids
        return ids


def _messages(service: GenerationService, data: object) -> None:
    anthropic_api.prepare_message(service, parse_body(data, MessagesRequest))


def _count_tokens(service: GenerationService, data: object) -> None:
    anthropic_api._prompt(service, parse_body(data, CountTokensRequest))


def _chat(service: GenerationService, data: object) -> None:
    openai_chat.prepare_chat(service, parse_body(data, ChatRequest))


def _completions(service: GenerationService, data: object) -> None:
    openai_completions.prepare_completion(service, parse_body(data, CompletionRequest))


# The routes whose bodies are checked off the loop: each runs the route's own checks.
PRECHECKS: dict[str, Callable[[GenerationService, object], None]] = {
    "/v1/messages": _messages,
    "/v1/messages/count_tokens": _count_tokens,
    "/v1/chat/completions": _chat,
    "/v1/completions": _completions,
}


class Offloader:
    """A bounded pool for pre-checks: `threads` at once, `threads * queue_factor` waiting
    at most (a 529 / 429 beyond)."""

    def __init__(
        self, threads: int, on_change: Callable[[int], None] | None = None, queue_factor: int = 8
    ) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenfleet-check")
        self._slots = asyncio.Semaphore(threads)
        self._max_waiting = threads * queue_factor
        self._waiting = 0
        self._running = 0
        self._on_change = on_change

    def _changed(self, delta: int) -> None:
        self._running += delta
        if self._on_change is not None:
            self._on_change(self._running)

    async def precheck(self, path: str, service: GenerationService, body: bytes) -> _Memo | None:
        """Run `path`'s checks on `body` in the pool: the tokens it computed, for the route
        to replay; APIError for a 4xx it found; None where it could not tell (the route
        then checks it all itself, as for a small body)."""
        if self._waiting >= self._max_waiting:
            raise APIError(
                529, "overloaded", "overloaded: too many large requests being checked; retry"
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        memo: _Memo = {}
        context = contextvars.copy_context()
        context.run(_RECORD.set, memo)
        self._changed(1)
        try:
            loop = asyncio.get_running_loop()
            check = PRECHECKS[path]
            await loop.run_in_executor(self._pool, context.run, _check, check, service, body)
        except APIError:
            raise
        except Exception:
            return None
        finally:
            self._changed(-1)
            self._slots.release()
        return memo

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check(check: Callable[[GenerationService, object], None], service: Any, body: bytes) -> None:
    check(service, msgspec.json.decode(body))


def replaying(memo: _Memo) -> None:
    """The current request's route takes its tokens from `memo` (Offloader.precheck)."""
    _REPLAY.set(memo)


def replayed_receive(body: bytes, receive: Receive) -> Receive:
    """`receive` with the already-read body given first, as one message."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
