"""Admission control: the gateway's view of its requests in flight, and the time to first
token a new interactive prompt would see behind them, priced by the engine's own step-time
model (step_model.py).

    in flight:  [interactive, no first token yet]  ──first token──▶  [decoding]  ──▶ gone
                 └── prompts ahead, FCFS ──┘                           (finish / abort)

The prediction replays the engine's schedule (scheduler.py) on those numbers: each step
the running interactive decodes take one token each of `max_num_batched_tokens`, the
prompts ahead and then the new one fill the rest in chunks, and running batch decodes ride
along in what is left; each step costs what the step-time model says, and the TTFT is the
sum up to the step that finishes the new prompt. Under the priority policy (a StepLimit,
harvest.py) prompt chunks beside interactive decodes are cut to the step limit (at least
the floor), and where batch work is in flight it fills each step up to the limit. Before
the engine has sent coefficients, an exponential moving average of the prefill speed seen
from the gateway stands in.

Torch-free; time is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenfleet.policy.harvest import pack, target_reachable, with_floor
from tokenfleet.policy.step_model import TERMS, LinearStepCost, StepFeatures

# predict_ttft replays this many steps one by one, then at most as many strides of several
# alike steps (a few ms of the gateway's event loop, where every stream's events wait; at
# the default targets it stops sooner).
MAX_REPLAY_STEPS = 64


@dataclass(frozen=True, slots=True)
class Decodes:
    """Running decodes: how many, and the KV tokens they read in all in their next step."""

    num_seqs: int = 0
    num_kv_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepLimit:
    """The priority policy's limit on a step beside interactive work (harvest.py):
    `seconds` = TPOT target less the margin; prompts beside decodes get at least
    `min_prefill_chunk` tokens a step, as far as the TPOT target itself
    (`target_seconds`) allows (harvest.with_floor)."""

    seconds: float
    min_prefill_chunk: int
    target_seconds: float


def step_seconds(coefficients: Mapping[str, float], features: StepFeatures) -> float:
    """A step's predicted time: the step-time model with `coefficients` (term -> value)."""
    values = zip(TERMS, features.values(), strict=True)
    return sum(coefficients.get(term, 0.0) * v for term, v in values)


def predict_ttft(
    coefficients: Mapping[str, float],
    max_num_batched_tokens: int,
    num_prompt_tokens: int,
    prompts_ahead: Sequence[int] = (),
    interactive: Decodes = Decodes(),
    batch: Decodes = Decodes(),
    limit: StepLimit | None = None,
    batch_in_flight: bool | None = None,
    profile: Mapping[str, float] | None = None,
    long_prefill_cap: int = 0,
    stop_over: float = math.inf,
    max_steps: int = MAX_REPLAY_STEPS,
) -> float:
    """Seconds until a new interactive prompt of `num_prompt_tokens` is prefilled, behind
    the interactive `prompts_ahead` (oldest first) and with the given running decodes.
    With `long_prefill_cap` (the scheduler's long_prefill_token_threshold), the oldest
    prompt takes at most that many tokens a step while others wait, and what they leave.

    A prompt ahead whose prefill ends joins the interactive decodes from the next step on,
    and every decode's context grows by a token a step. Prefix-cache hits are not known
    here, so every prompt is priced in full (a pessimistic bound). With a `limit`, prompt
    chunks beside interactive decodes are cut to it, and a step with batch work in flight
    (`batch_in_flight`, by default: batch decodes running) takes at least the limit.

    The replay stops at the first step that takes the total over `stop_over`: the answer
    is then a lower bound over it, which is all admission needs to know, and the replay
    stays short (behind a whole-context prompt cut to a few tokens a step it would run
    thousands of steps, hundreds of ms of the gateway's event loop). Under a target so far
    off that it has not stopped after `max_steps` steps, the rest is replayed in at most as
    many strides: a stride repeats one step's plan as many times as finishes the prompts
    in the strides left (never through a prompt's last chunk: that step is replayed
    alone), each step priced with its contexts as far on as they are by then (the cost is
    linear in them: the mean of the first and last step's). What it leaves out is the plan
    itself changing within a stride (chunks cut to the step limit shrink as contexts grow:
    it errs low)."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}")
    # [tokens scheduled, prompt length] of each prompt still to prefill, oldest first.
    prefills = deque([0, n] for n in (*prompts_ahead, num_prompt_tokens))
    mine = prefills[-1]
    num_i, kv_i = interactive.num_seqs, interactive.num_kv_tokens
    num_b, kv_b = batch.num_seqs, batch.num_kv_tokens
    total = 0.0
    steps = 0
    priced = LinearStepCost.from_dict(dict(coefficients))
    # As the engine asks it: of its start-up profile's fit (`profile`) when there is one.
    reference = LinearStepCost.from_dict(dict(profile)) if profile else priced
    reachable = limit is not None and target_reachable(
        reference, limit.target_seconds, limit.min_prefill_chunk
    )
    while True:
        # max(.., 1): with more decodes than budget the engine would stall prefill; never
        # with max_num_seqs under max_num_batched_tokens, and the loop must end.
        budget = max(max_num_batched_tokens - num_i, 1)
        step = StepFeatures(decode_seqs=num_i, kv_tokens_read=kv_i)
        if limit is not None and num_i and reachable:
            chunks = [(done, n - done) for done, n in prefills]
            fits = pack(priced, step, chunks, limit.seconds, budget)
            budget = min(
                budget,
                with_floor(
                    priced,
                    step,
                    chunks,
                    fits,
                    limit.seconds,
                    limit.target_seconds,
                    limit.min_prefill_chunk,
                    budget,
                ),
            )
        planned, budget = _plan_prompts(prefills, budget, long_prefill_cap)
        stride = _stride(prefills, planned, 2 * max_steps - steps) if steps >= max_steps else 1
        in_flight = num_b > 0 if batch_in_flight is None else batch_in_flight
        first = step + StepFeatures.of_chunks([(n, p[0]) for p, n in planned])
        seconds, riding = _with_batch(coefficients, first, budget, batch, kv_b, limit, in_flight)
        if stride > 1:
            # Its last step reads every context k tokens further on; the cost is linear in
            # them, so the stride's mean step is the mean of its first and last.
            k = stride - 1
            last = StepFeatures(decode_seqs=num_i, kv_tokens_read=kv_i + num_i * k)
            last += StepFeatures.of_chunks([(n, p[0] + n * k) for p, n in planned])
            kv_batch = kv_b + riding * k
            last_seconds, _ = _with_batch(
                coefficients, last, budget, batch, kv_batch, limit, in_flight
            )
            seconds = (seconds + last_seconds) / 2
        joined, joined_kv = 0, 0
        for prompt, num_new in planned:
            prompt[0] += num_new * stride
            if prompt[0] == prompt[1]:
                # Its first token is sampled now; next step it decodes at its length.
                joined, joined_kv = joined + 1, joined_kv + prompt[1] + 1
        prefills = deque(p for p in prefills if p[0] < p[1])
        total += seconds * stride
        if mine[0] == mine[1] or total > stop_over:
            return total
        steps += 1
        kv_i += num_i * stride + joined_kv
        num_i += joined
        kv_b += riding * stride


def _stride(
    prefills: Sequence[list[int]], planned: Sequence[tuple[list[int], int]], strides_left: int
) -> int:
    """How many times to repeat a step's plan (`planned`, before it is applied): enough to
    prefill what is left of the prompts in `strides_left` such strides, but never through a
    prompt's last chunk (1 where this step ends one)."""
    per_step = sum(num_new for _, num_new in planned)
    if not per_step:
        return 1
    left = sum(n - done for done, n in prefills)
    want = math.ceil(left / (per_step * max(strides_left, 1)))
    return max(1, min(want, *((p[1] - p[0]) // num_new for p, num_new in planned)))


def _with_batch(
    coefficients: Mapping[str, float],
    step: StepFeatures,
    budget_left: int,
    batch: Decodes,
    batch_kv: int,
    limit: StepLimit | None,
    batch_in_flight: bool,
) -> tuple[float, int]:
    """A step's seconds once batch work joins its interactive part `step`, and how many
    batch decodes ride along: without a limit (fcfs), the running ones in the tokens
    left (reading `batch_kv` in all); with one, batch fills the step up to it."""
    riding = min(batch.num_seqs, budget_left) if limit is None else 0
    if riding:
        step += StepFeatures(decode_seqs=riding, kv_tokens_read=batch_kv * riding // batch.num_seqs)
    seconds = step_seconds(coefficients, step)
    if limit is not None and batch_in_flight:
        seconds = max(seconds, limit.seconds)
    return seconds, riding


def _plan_prompts(
    prefills: Sequence[list[int]], budget: int, cap: int
) -> tuple[list[tuple[list[int], int]], int]:
    """(prompt, tokens) of a step's prompt chunks, FCFS within `budget`, and the budget
    left. With a `cap` and others waiting, the oldest takes at most `cap` tokens first and
    then what the others leave (Scheduler._top_up)."""
    planned: list[tuple[list[int], int]] = []
    capped = bool(cap) and len(prefills) > 1
    for i, prompt in enumerate(prefills):
        if not budget:
            break
        want = prompt[1] - prompt[0]
        num_new = min(want, budget, cap if capped and i == 0 else want)
        planned.append((prompt, num_new))
        budget -= num_new
    if capped and budget and planned:
        first, given = planned[0]
        more = min(first[1] - first[0] - given, budget)
        planned[0] = (first, given + more)
        budget -= more
    return planned, budget


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
    ) -> None:
        """`limit`: the engine's step limit under the priority policy (None for fcfs);
        `long_prefill_cap`: its scheduler's long_prefill_token_threshold (0: none)."""
        if ttft_target_s <= 0 or initial_prefill_tokens_per_s <= 0:
            raise ValueError("the TTFT target and the initial prefill speed must be positive")
        self.ttft_target_s = ttft_target_s
        self.prefill_tokens_per_s = initial_prefill_tokens_per_s
        self.limit = limit
        self.long_prefill_cap = long_prefill_cap
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
            )
        return seconds, "step_model"

    def _one_step(
        self, num_prompt_tokens: int, coefficients: Mapping[str, float], max_num_batched_tokens: int
    ) -> float | None:
        """predict_ttft where the prompts ahead and the new one all fit the next step, from
        the running totals (a burst of short prompts: each one costs the same, however many
        came before it); None where predict_ttft must replay more steps, or cut prompts to
        the step limit beside interactive decodes."""
        requests = self.requests
        interactive = requests.decodes(interactive=True)
        left = max(max_num_batched_tokens - interactive.num_seqs, 1)
        left -= requests.ahead_tokens + num_prompt_tokens
        if left < 0 or (self.limit is not None and interactive.num_seqs):
            return None
        step = StepFeatures(
            decode_seqs=interactive.num_seqs, kv_tokens_read=interactive.num_kv_tokens
        )
        step += requests.ahead_features + StepFeatures.of_chunk(num_prompt_tokens, 0)
        batch = requests.decodes(interactive=False)
        seconds, _ = _with_batch(
            coefficients, step, left, batch, batch.num_kv_tokens, self.limit, requests.has_batch
        )
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
        stops once over the target, so the excess is a lower bound. `profile`: the engine's
        start-up profile's coefficients (predict_ttft)."""
        seconds, predictor = self.predict(
            num_prompt_tokens, coefficients, max_num_batched_tokens, profile
        )
        if seconds <= self.ttft_target_s:
            return Verdict(seconds, predictor)
        return Verdict(seconds, predictor, max(1, math.ceil(seconds - self.ttft_target_s)))

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
