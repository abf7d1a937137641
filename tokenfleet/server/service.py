"""What both APIs share: prompts to token ids, validation, admission, and a stream of text
deltas (detokenized, stop strings applied) for one engine request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Coroutine, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from prometheus_client import Histogram

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.core.engine_api import EngineCoreRequest, TokenLogprobs
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.engine.client import EngineDeadError, RequestFailedError
from tokenfleet.engine.replica_client import ReplicaClient
from tokenfleet.engine.wire import EngineReady
from tokenfleet.errors import InvalidRequestError
from tokenfleet.policy.admission import AdmissionControl, FirstToken, StepLimit, Verdict
from tokenfleet.policy.harvest import step_time_limit
from tokenfleet.server.autoscale import WindowCounts
from tokenfleet.server.detokenizer import IncrementalDetokenizer, StopChecker
from tokenfleet.server.errors import APIError
from tokenfleet.server.ids import random_hex
from tokenfleet.server.keys import ANONYMOUS_GROUP, CALLER_GROUP
from tokenfleet.server.limits import Limiter, RateLimiter
from tokenfleet.server.metrics import Metrics
from tokenfleet.server.settings import ServeConfig

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Priority classes as the engine's scheduler orders them (lower first).
PRIORITIES = {"interactive": 0, "batch": 1}

_ERROR_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16)


class ClientDisconnected(Exception):
    """The caller went away before its non-streamed reply was ready."""


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work` (collecting a non-streamed reply) unless the client disconnects first:
    then cancel it, which closes its generation and so aborts the engine request, and
    raise ClientDisconnected. (A streamed reply needs none of this: sse.EventStream stops
    the stream, and closing it aborts the request.)"""
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
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first token, if asked
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache


# The server's task of the HTTP request being served (PendingRequests.entered), in its context.
_REQUEST_TASK: ContextVar[asyncio.Task[Any] | None] = ContextVar(
    "tokenfleet_request_task", default=None
)


class PendingRequests:
    """The HTTP requests the server has taken in that have not reached the engine yet: a
    burst's later requests, still being parsed one after another on this event loop. Sent
    with each request (AddRequests.num_pending), so that an idle engine waits for them
    (within its arrival window) instead of guessing from the pauses between arrivals: a
    collector pause or a busy core in the gateway would split the burst across two first
    steps, and the later part would wait a whole step.

    `tasks`: the HTTP server's set of request tasks (uvicorn starts one per request once it
    has read the headers, before the request runs; it leaves the set when done); None when
    the app runs under a server that does not expose it, and the count is then unknown. A
    request passes when it submits to the engine, or at once for a route that never does.
    The gateway marks each request's task as it enters (`entered`), since the work may go
    on in tasks of its own (cancel_on_disconnect, n > 1 choices), which share its context."""

    def __init__(self, tasks: set[asyncio.Task[None]] | None) -> None:
        self._tasks = tasks
        self._passed: set[asyncio.Task[Any]] = set()

    @staticmethod
    def entered() -> None:
        """The current task is the server's task of a request that has just entered."""
        _REQUEST_TASK.set(asyncio.current_task())

    def passed(self) -> None:
        """The current request will not (or will no longer) reach the engine."""
        task = _REQUEST_TASK.get()
        if self._tasks is None or task is None or task not in self._tasks:
            return  # not a request (the batch dispatcher), or not one the server counts
        if task not in self._passed:
            self._passed.add(task)
            task.add_done_callback(self._passed.discard)

    def count(self) -> int | None:
        """How many requests the server has taken in that have not passed yet."""
        if self._tasks is None:
            return None
        return max(0, len(self._tasks) - len(self._passed))

    def reached(self) -> int | None:
        """The current request reaches the engine: how many others are still on their way."""
        self.passed()
        return self.count()


class GenerationService:
    def __init__(
        self,
        client: ReplicaClient,
        tokenizer: Tokenizer,
        config: ServeConfig,
        metrics: Metrics,
        server_tasks: set[asyncio.Task[None]] | None = None,
    ) -> None:
        self.client = client
        self.pending = PendingRequests(server_tasks)
        client.count_pending = self.pending.count
        client.startup_timeout_s = config.engine_start_timeout_s
        client.restart_backoff_s = config.engine_restart_backoff_s
        client.restart_backoff_max_s = config.engine_restart_backoff_max_s
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        # Per key group, interactive only; the store's instead when shared (app.py).
        self.limiter: Limiter = RateLimiter(config.limits)
        engine = client.config
        # Requests ended here, and those within both targets (the fleet autoscaler's window).
        self.window = WindowCounts(config.ttft_target_s, engine.tpot_target_s)
        limit = None
        if engine.scheduling_policy == "priority":
            seconds = step_time_limit(engine.tpot_target_s, engine.harvest_margin)
            limit = StepLimit(seconds, engine.min_prefill_chunk, engine.tpot_target_s)
        # The cut the engine's scheduler makes (none under fcfs: SchedulerConfig.under).
        scheduler = engine.scheduler.under(engine.scheduling_policy)
        self.admission = AdmissionControl(
            config.ttft_target_s,
            config.initial_prefill_tokens_per_s,
            limit,
            scheduler.long_prefill_token_threshold,
            max_num_seqs=scheduler.max_num_seqs,
            block_size=engine.cache.block_size,
        )
        # metrics.py is the engine's and the latency histograms' file; this one is admission's.
        self.ttft_prediction_error = Histogram(
            "tokenfleet_ttft_prediction_error_ratio",
            "relative error |predicted - measured| / measured of admitted interactive "
            "requests' predicted time to first token, by predictor (step_model or ema)",
            ("predictor",),
            buckets=_ERROR_BUCKETS,
            registry=metrics.registry,
        )

    def _engine_info(self) -> EngineReady:
        info = self.client.info
        if info is None:
            raise APIError(503, "engine_down", "the engine is starting; try again shortly")
        return info

    @property
    def max_model_len(self) -> int:
        return self._engine_info().max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine_info().vocab_size

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
                "context_length",
                f"prompt ({num_prompt_tokens} tokens) plus {param} ({max_tokens}) is "
                f"{num_prompt_tokens + max_tokens} tokens, over the context length of {limit}",
                param=param,
            )

    def admit(self, num_prompt_tokens: int, priority: str = "interactive") -> Verdict | None:
        """Refuse at once an interactive request that could not get its first token within
        the TTFT target (529 here, 429 at the OpenAI edge). Batch is never refused for load.
        An admitted interactive request's verdict goes to `generate`, which scores it."""
        if not self.client.is_healthy():
            raise APIError(503, "engine_down", "the engine is not running; try again shortly")
        if priority == "batch":
            return None
        verdict = self._predict(num_prompt_tokens)
        if not verdict.admitted:
            raise APIError(
                529,
                "overloaded",
                "overloaded: the predicted time to first token (at least "
                f"{verdict.predicted_ttft_s:.2f} s) exceeds the target "
                f"({self.config.ttft_target_s:.2f} s); retry later",
                retry_after_s=verdict.retry_after_s,
            )
        return verdict

    def _predict(self, num_prompt_tokens: int) -> Verdict:
        fleet = self.client.predict_ttft(num_prompt_tokens)
        if fleet is not None:  # replicas on Ray: judged from their own reports
            return fleet
        # The engine's own step-time model, from its latest step or heartbeat; none yet
        # (starting, or a restarted engine) leaves admission to its EMA fallback.
        stats = self.client.stats
        coefficients = stats.step_time_coefficients if stats is not None else {}
        profile = stats.step_time_profile if stats is not None else {}
        budget = self.client.config.scheduler.max_num_batched_tokens
        return self.admission.check(num_prompt_tokens, coefficients, budget, profile)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop: Sequence[str] = (),
        *,
        route: str,
        priority: str = "interactive",
        announce: bool = False,
        predicted: Verdict | None = None,
    ) -> AsyncGenerator[TextDelta, None]:
        """The request's text as it is generated, one TextDelta per engine output. With
        `announce`, first an empty delta (no tokens, no finish) as soon as the engine has
        the request: a streamed reply starts on it and is under way when the first token
        comes, instead of every stream of a burst setting up its reply after that token.
        `predicted`: admission's verdict (`admit`), scored against the measured time to
        first token; an interactive request given none is predicted here."""
        num_prompt = len(prompt_token_ids)
        # The caller's key group (None without keys): its limits, and its own prefix cache.
        group = CALLER_GROUP.get()
        if priority == "interactive":
            await self.limiter.charge(group or ANONYMOUS_GROUP, num_prompt + params.max_tokens)
        request = EngineCoreRequest(
            f"gen-{random_hex(32)}",
            prompt_token_ids,
            params,
            time.monotonic(),
            priority=PRIORITIES[priority],
            cache_salt=group,
        )
        start = last = time.monotonic()
        waiting_first = True
        first_s = 0.0
        num_output = 0
        interactive = priority == "interactive"
        if predicted is None and interactive:
            predicted = self._predict(num_prompt)
        self.admission.requests.add(request.req_id, num_prompt, interactive=interactive, now=start)
        try:
            submitted = self.client.submit(request, self.pending.reached())
            async with contextlib.aclosing(await submitted) as outputs:
                self.metrics.prompt_tokens.inc(num_prompt)
                if announce:
                    # Requests that came in with this one (a burst) reach the engine before
                    # this one's reply, or even its detokenizer, is set up: that can wait
                    # until the burst is in (or the engine's next output).
                    await self.client.settled()
                    yield TextDelta("", [], 0)
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
                stopper = StopChecker(list(stop))
                ttft, tpot, e2e = self.metrics.latency_series(route, priority)
                # Metrics are recorded once the step's other streams had their turn: the
                # outputs of one step wake every stream at once, and each waits for those
                # before it, so what can wait, waits (call_soon runs after them).
                later = asyncio.get_running_loop().call_soon
                async for out in outputs:
                    # When the engine's step reached the gateway: the metrics are the
                    # engine's and the way to it; what the gateway adds after is the
                    # HTTP layer's (bench/gateway_overhead.py measures it apart).
                    now = outputs.arrived
                    if waiting_first:
                        waiting_first, first_s = False, now - start
                        first = self.admission.first_token(request.req_id, now)
                        later(self._observe_first_token, first, predicted, ttft, now - start)
                    elif out.new_token_ids:
                        later(tpot.observe, now - last)
                    last = now
                    num_output += len(out.new_token_ids)
                    later(self.metrics.generation_tokens.inc, len(out.new_token_ids))
                    if not interactive:
                        self.window.batch_tokens_generated += len(out.new_token_ids)
                    shown = out.new_token_ids
                    if out.stop_token_id is not None:
                        shown = shown[:-1]
                    text, matched = stopper.feed(detok.add_tokens(shown))
                    delta = TextDelta(text, out.new_token_ids, num_output, out.logprobs or [])
                    delta.prompt_logprobs = out.prompt_logprobs
                    delta.num_cached_tokens = out.num_cached_tokens
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
                        e2e.observe(time.monotonic() - start)
                        self.window.finished(interactive, first_s, now - start, num_output)
                        return
        except EngineDeadError as exc:
            raise APIError(503, "engine_down", str(exc)) from exc
        except RequestFailedError as exc:  # this request's own failure in the engine
            raise APIError(500, "internal", f"the request failed: {exc.message}") from exc
        except InvalidRequestError as exc:
            raise APIError(400, "invalid_request", exc.message, param=exc.param) from exc
        except APIError:
            raise
        except Exception as exc:  # its detokenizing, say: this request's failure alone
            logger.exception("request %s failed in the gateway", request.req_id)
            message = f"the request failed: internal error ({type(exc).__name__})"
            raise APIError(500, "internal", message) from exc
        finally:
            self.admission.requests.remove(request.req_id)

    def _observe_first_token(
        self, first: FirstToken | None, predicted: Verdict | None, ttft: Histogram, seconds: float
    ) -> None:
        ttft.observe(seconds)
        # A verdict over the target is a lower bound (the replay stopped there): not scored.
        if first is not None and predicted is not None and predicted.admitted and first.ttft_s > 0:
            error = abs(predicted.predicted_ttft_s - first.ttft_s) / first.ttft_s
            self.ttft_prediction_error.labels(predicted.predictor).observe(error)
