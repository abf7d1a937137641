"""Admission control: the gateway's view of its requests in flight, and the time to first
token a new interactive prompt would see behind them, priced by the engine's own step-time
model (step_model.py).

    in flight:  [interactive, no first token yet]  ──first token──▶  [decoding]  ──▶ gone
                 └── prompts ahead, FCFS ──┘                           (finish / abort)

The prediction replays the engine's own planning on those numbers (replay.py's Replay
and predict_ttft): the Scheduler's token split, shared with it (core/planning.py, on
lengths alone: a cache that never runs short and never hits), within harvest.py's prompt
and batch budgets under the priority policy (a StepLimit). The running decodes each take
a token, the prompts ahead (taken as running, none of their tokens computed yet) and
then the new one, waiting, fill the rest in chunks; each step costs what the step-time
model says, and the TTFT is the sum up to the step that finishes the new prompt. Under
the priority policy a step with batch work in flight takes at least the step limit
(batch fills it up to there). Before the engine has sent coefficients, an exponential
moving average of the prefill speed seen from the gateway stands in.

Torch-free; time is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tokenfleet.policy.replay import (
    DEFAULT_BLOCK_SIZE,
    MAX_REPLAY_CHUNKS,
    MAX_REPLAY_STEPS,
    UNLIMITED_SEQS,
    Decodes,
    Replay,
    StepLimit,
    predict_ttft,
)
from tokenfleet.policy.step_model import LinearStepCost, StepFeatures

__all__ = [  # the replay's names, as admission's callers know them
    "DEFAULT_BLOCK_SIZE",
    "MAX_REPLAY_CHUNKS",
    "MAX_REPLAY_STEPS",
    "UNLIMITED_SEQS",
    "AdmissionControl",
    "Decodes",
    "FirstToken",
    "InFlightRequests",
    "Replay",
    "StepLimit",
    "Verdict",
    "predict_ttft",
]


@dataclass(slots=True)
class _InFlight:
    num_prompt_tokens: int
    interactive: bool
    arrival_time: float
    first_token_time: float | None = None


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A request's first token, and how long it took to come."""

    ttft_s: float
    num_prompt_tokens: int
    interactive: bool


class InFlightRequests:
    """Every request this gateway has sent to the engine and not yet seen end, with running
    totals kept as requests come, get their first token and go: admission reads them for
    every interactive request, and a burst's k-th request must not walk the k - 1 before it."""

    def __init__(self) -> None:
        self._requests: dict[str, _InFlight] = {}  # in arrival order
        self._ahead: dict[str, int] = {}  # interactive, no first token yet: prompt lengths
        self.ahead_tokens = 0
        self.ahead_features = StepFeatures()  # the ahead prompts, each a whole chunk
        self._num = [0, 0]  # decoding requests: interactive, batch
        self._kv = [0, 0]
        self._num_batch = 0

    def __len__(self) -> int:
        return len(self._requests)

    def add(
        self,
        req_id: str,
        num_prompt_tokens: int,
        *,
        interactive: bool,
        now: float,
    ) -> None:
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already in flight")
        self._requests[req_id] = _InFlight(num_prompt_tokens, interactive, now)
        if interactive:
            self._ahead[req_id] = num_prompt_tokens
            self.ahead_tokens += num_prompt_tokens
            self.ahead_features += StepFeatures.of_chunk(num_prompt_tokens, 0)
        else:
            self._num_batch += 1

    def first_token(self, req_id: str, now: float) -> FirstToken | None:
        """Mark the request as decoding; None if unknown or already past its first token."""
        request = self._requests.get(req_id)
        if request is None or request.first_token_time is not None:
            return None
        request.first_token_time = now
        self._leave_ahead(req_id)
        i = 0 if request.interactive else 1
        self._num[i] += 1
        self._kv[i] += request.num_prompt_tokens + 1
        return FirstToken(
            now - request.arrival_time,
            request.num_prompt_tokens,
            request.interactive,
        )

    def remove(self, req_id: str) -> None:
        """The request finished or was aborted (a no-op for one never added)."""
        request = self._requests.pop(req_id, None)
        if request is None:
            return
        if not request.interactive:
            self._num_batch -= 1
        if request.first_token_time is None:
            self._leave_ahead(req_id)
        else:
            i = 0 if request.interactive else 1
            self._num[i] -= 1
            self._kv[i] -= request.num_prompt_tokens + 1

    def _leave_ahead(self, req_id: str) -> None:
        n = self._ahead.pop(req_id, None)
        if n is not None:
            self.ahead_tokens -= n
            self.ahead_features -= StepFeatures.of_chunk(n, 0)

    @property
    def num_ahead(self) -> int:
        """How many interactive requests wait for their first token."""
        return len(self._ahead)

    def prompts_ahead(self) -> list[int]:
        """Prompt lengths of interactive requests still waiting for their first token,
        oldest first: the prefill work a new interactive request queues behind."""
        return list(self._ahead.values())

    def decodes(self, *, interactive: bool) -> Decodes:
        """The class's requests past their first token. Their context is counted as the
        prompt plus one token: the gateway does not track each one's outputs here."""
        i = 0 if interactive else 1
        return Decodes(self._num[i], self._kv[i])

    @property
    def has_batch(self) -> bool:
        """Whether batch work is in flight."""
        return self._num_batch > 0

    def snapshot(self) -> tuple[list[int], Decodes, Decodes, bool]:
        """prompts_ahead(), decodes() of each class and whether batch work is in flight."""
        return (
            self.prompts_ahead(),
            self.decodes(interactive=True),
            self.decodes(interactive=False),
            self.has_batch,
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """Admission's answer for one prompt. `retry_after_s` is None when it is admitted."""

    predicted_ttft_s: float
    predictor: str  # "step_model" or "ema"
    retry_after_s: int | None = None

    @property
    def admitted(self) -> bool:
        return self.retry_after_s is None


class AdmissionControl:
    """Refuses an interactive prompt whose predicted TTFT exceeds `ttft_target_s`."""

    # The EMA fallback learns only from prompts long enough for prefill to dominate.
    EMA_MIN_PROMPT_TOKENS = 32
    EMA_WEIGHT = 0.2

    def __init__(
        self,
        ttft_target_s: float,
        initial_prefill_tokens_per_s: float,
        limit: StepLimit | None = None,
        long_prefill_cap: int = 0,
        *,
        max_num_seqs: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        """`limit`: the engine's step limit under the priority policy (None for fcfs);
        `long_prefill_cap`: its scheduler's long_prefill_token_threshold (0: none);
        `max_num_seqs` (None: not modelled) and `block_size`: its own (predict_ttft)."""
        if ttft_target_s <= 0 or initial_prefill_tokens_per_s <= 0:
            raise ValueError("the TTFT target and the initial prefill speed must be positive")
        self.ttft_target_s = ttft_target_s
        self.prefill_tokens_per_s = initial_prefill_tokens_per_s
        self.limit = limit
        self.long_prefill_cap = long_prefill_cap
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.requests = InFlightRequests()

    def predict(
        self,
        num_prompt_tokens: int,
        coefficients: Mapping[str, float],
        max_num_batched_tokens: int,
        profile: Mapping[str, float] | None = None,
    ) -> tuple[float, str]:
        """The predicted TTFT of a new interactive prompt, and which predictor gave it;
        over the target, a lower bound (predict_ttft's `stop_over`)."""
        requests = self.requests
        if not any(v > 0 for v in coefficients.values()):
            tokens = requests.ahead_tokens + num_prompt_tokens
            return tokens / self.prefill_tokens_per_s, "ema"
        seconds = self._one_step(num_prompt_tokens, coefficients, max_num_batched_tokens)
        if seconds is None:
            ahead, interactive, batch, has_batch = requests.snapshot()
            seconds = predict_ttft(
                coefficients,
                max_num_batched_tokens,
                num_prompt_tokens,
                ahead,
                interactive,
                batch,
                self.limit,
                has_batch,
                profile,
                self.long_prefill_cap,
                stop_over=self.ttft_target_s,
                max_num_seqs=self.max_num_seqs,
                block_size=self.block_size,
            )
        return seconds, "step_model"

    def _one_step(
        self, num_prompt_tokens: int, coefficients: Mapping[str, float], max_num_batched_tokens: int
    ) -> float | None:
        """predict_ttft where the decodes, the prompts ahead and the new one all fit the
        next step, from the running totals (a burst of short prompts: each one costs the
        same, however many came before it); None where predict_ttft must replay more
        steps, or cut prompts to the step limit beside interactive decodes. Under the
        priority policy batch is planned after the prompts and kept within the limit, so
        the step is its interactive part, or the limit with batch in flight."""
        requests = self.requests
        interactive = requests.decodes(interactive=True)
        batch = requests.decodes(interactive=False)
        fcfs = self.limit is None
        decodes = Decodes(
            interactive.num_seqs + batch.num_seqs * fcfs,
            interactive.num_kv_tokens + batch.num_kv_tokens * fcfs,
        )
        left = max_num_batched_tokens - decodes.num_seqs
        left -= requests.ahead_tokens + num_prompt_tokens
        # A one-token prompt ahead is a one-token query, as harvest.prefill_budget counts
        # decodes: beside one, prompts are cut under the priority policy too.
        beside_decodes = interactive.num_seqs or requests.ahead_features.decode_seqs
        if left < 0 or (not fcfs and beside_decodes):
            return None
        num_running = interactive.num_seqs + batch.num_seqs + requests.num_ahead
        if self.max_num_seqs is not None and num_running >= self.max_num_seqs:
            return None
        step = StepFeatures(decode_seqs=decodes.num_seqs, kv_tokens_read=decodes.num_kv_tokens)
        step += requests.ahead_features + StepFeatures.of_chunk(num_prompt_tokens, 0)
        seconds = LinearStepCost.from_dict(dict(coefficients)).predict(step)
        if self.limit is not None and requests.has_batch:
            return max(seconds, self.limit.seconds)
        return seconds

    def check(
        self,
        num_prompt_tokens: int,
        coefficients: Mapping[str, float],
        max_num_batched_tokens: int,
        profile: Mapping[str, float] | None = None,
    ) -> Verdict:
        """Admit at or under the target; over it, refuse with Retry-After = the predicted
        excess rounded up to whole seconds (at least 1), as far as the replay went: it
        stops once over the target, so the excess is a lower bound. Where the prompt is
        predicted never to get in (decodes fill every step), Retry-After is the target,
        rounded up. `profile`: the engine's start-up profile's coefficients (predict_ttft)."""
        seconds, predictor = self.predict(
            num_prompt_tokens, coefficients, max_num_batched_tokens, profile
        )
        if seconds <= self.ttft_target_s:
            return Verdict(seconds, predictor)
        excess = seconds - self.ttft_target_s if math.isfinite(seconds) else self.ttft_target_s
        return Verdict(seconds, predictor, max(1, math.ceil(excess)))

    def first_token(self, req_id: str, now: float) -> FirstToken | None:
        """Record a first token; an interactive one also teaches the EMA fallback the
        prefill speed (a batch request's TTFT includes its wait behind interactive work)."""
        first = self.requests.first_token(req_id, now)
        if (
            first is not None
            and first.interactive
            and first.ttft_s > 0
            and first.num_prompt_tokens >= self.EMA_MIN_PROMPT_TOKENS
        ):
            rate = first.num_prompt_tokens / first.ttft_s
            w = self.EMA_WEIGHT
            self.prefill_tokens_per_s = (1 - w) * self.prefill_tokens_per_s + w * rate
        return first
