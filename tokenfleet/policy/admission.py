"""Admission control: the gateway's view of its requests in flight, and the time to first
token a new interactive prompt would see behind them, priced by the engine's own step-time
model (step_model.py).

    in flight:  [interactive, no first token yet]  ──first token──▶  [decoding]  ──▶ gone
                 └── prompts ahead, FCFS ──┘                           (finish / abort)

The prediction replays the engine's own planning on those numbers (Replay): the
Scheduler's token split, shared with it (core/planning.py, on lengths alone: a cache that
never runs short and never hits), within harvest.py's prompt and batch budgets under the
priority policy (a StepLimit). The running decodes each take a token, the prompts ahead
(taken as running, none of their tokens computed yet) and then the new one, waiting,
fill the rest in chunks; each step costs what the step-time model says, and the TTFT is
the sum up to the step that finishes the new prompt. Under the priority policy a step
with batch work in flight takes at least the step limit (batch fills it up to there).
Before the engine has sent coefficients, an exponential moving average of the prefill
speed seen from the gateway stands in.

Torch-free; time is passed in. Over 400 lines: the replay needs harvest's budgets, so it
cannot join core/planning.py, and it serves this module's control alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenfleet.config import CacheConfig, SchedulerConfig
from tokenfleet.core.planning import Chunk, LengthPlanner, LengthRequest
from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from tokenfleet.policy.harvest import batch_budget, prefill_budget_within
from tokenfleet.policy.step_model import LinearStepCost, StepCost, StepFeatures

# predict_ttft replays this many steps one by one, then at most as many strides of several
# alike steps (a few ms of the gateway's event loop, where every stream's events wait; at
# the default targets it stops sooner). A step plans every running request: the strides
# begin sooner once the steps so far have planned this many requests' chunks in all.
MAX_REPLAY_STEPS = 64
MAX_REPLAY_CHUNKS = 1024
# The engine's block size, where the gateway is not told it: harvest prices a waiting
# prompt from its last full block (its dearest start).
DEFAULT_BLOCK_SIZE = CacheConfig().block_size
# max_num_seqs where the gateway is not told it: no limit (every request in flight fits).
UNLIMITED_SEQS = 2**31 - 1


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


class Replay:
    """The engine's queue as admission knows it, planned step by step as the engine plans
    it: LengthPlanner's token split (the Scheduler's rule) and, under a `limit` (the
    priority policy), harvest's prefill and batch budgets priced by `model` (its
    target_reachable by `reference`, by default `model`), as PriorityBudgets gives them.
    `max_num_seqs` None: no limit on the sequences in a step; `batch_step_limit_s`: the
    engine's, for steps of batch alone (the gateway is not told it: None)."""

    def __init__(
        self,
        max_num_batched_tokens: int,
        *,
        max_num_seqs: int | None = None,
        long_prefill_cap: int = 0,
        limit: StepLimit | None = None,
        model: StepCost | None = None,
        reference: StepCost | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        batch_step_limit_s: float | None = None,
    ) -> None:
        if limit is not None and model is None:
            raise ValueError("a step limit needs a step-time model to price the budgets")
        config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=UNLIMITED_SEQS if max_num_seqs is None else max_num_seqs,
            long_prefill_token_threshold=long_prefill_cap,
        )
        self.planner = LengthPlanner(config)
        self.limit, self.model, self.reference = limit, model, reference
        self.block_size, self.batch_step_limit_s = block_size, batch_step_limit_s

    def add(
        self,
        req_id: str,
        num_tokens: int,
        *,
        running: bool,
        num_computed_tokens: int = 0,
        num_prompt_tokens: int | None = None,
        interactive: bool = True,
        arrival_time: float | None = None,
    ) -> LengthRequest:
        """A request at the end of the running ones (as far on as `num_computed_tokens`)
        or of its class's waiting ones: LengthPlanner.add."""
        priority = PRIORITY_INTERACTIVE if interactive else PRIORITY_BATCH
        return self.planner.add(
            req_id,
            num_tokens,
            running=running,
            num_computed_tokens=num_computed_tokens,
            num_prompt_tokens=num_prompt_tokens,
            priority=priority,
            arrival_time=arrival_time,
        )

    def add_decodes(self, prefix: str, decodes: Decodes, *, interactive: bool) -> None:
        """`decodes` as running requests `prefix`0, `prefix`1, ..., their contexts the
        even split of what they read in all."""
        n = decodes.num_seqs
        if not n:
            return
        base, extra = divmod(max(decodes.num_kv_tokens - n, 0), n)
        for i in range(n):
            context = base + (i < extra)
            self.add(
                f"{prefix}{i}",
                context + 1,
                running=True,
                num_computed_tokens=context,
                num_prompt_tokens=context,
                interactive=interactive,
            )

    def step(self) -> list[Chunk]:
        """Plan the next step and commit it: its chunks, in running order."""
        if self.limit is None:
            return self.planner.step()
        planner, limit, model = self.planner, self.limit, self.model
        assert model is not None
        config = planner.config
        prefill = prefill_budget_within(
            model,
            planner.running,
            planner.waiting,
            limit_s=limit.seconds,
            tpot_target_s=limit.target_seconds,
            max_num_seqs=config.max_num_seqs,
            block_size=self.block_size,
            max_tokens=config.max_num_batched_tokens,
            min_tokens=limit.min_prefill_chunk,
            reference=self.reference,
        )

        def batch(interactive_chunks: list[tuple[int, int]]) -> int:
            return batch_budget(
                model,
                interactive_chunks,
                planner.running,
                planner.waiting,
                limit_s=limit.seconds,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                block_size=self.block_size,
                batch_step_limit_s=self.batch_step_limit_s,
            )

        return planner.step(batch_token_budget=batch, prefill_token_budget=prefill)

    def prompt_tokens_left(self) -> int:
        """The tokens still to compute of every request not decoding (prompts)."""
        return sum(
            r.num_tokens - r.num_computed_tokens
            for r in self.planner.requests.values()
            if isinstance(r, LengthRequest) and not r.decoding
        )


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
    *,
    max_num_seqs: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> float:
    """Seconds until a new interactive prompt of `num_prompt_tokens` is prefilled, behind
    the interactive `prompts_ahead` (oldest first) and with the given running decodes,
    as Replay plans it. `long_prefill_cap` is the scheduler's long_prefill_token_threshold;
    `max_num_seqs` and `block_size` the engine's, where known.

    The replay's queue: the interactive decodes, under fcfs (no `limit`) the batch ones in
    the same class (the engine schedules fcfs as one class), the prompts ahead, running
    with none of their tokens computed, under the priority policy the batch decodes in
    their class, and the new prompt waiting. A prompt whose prefill ends decodes from the
    next step on; no request finishes. Prefix-cache hits are not known here, so every
    prompt is priced in full (a pessimistic bound). With a `limit`, a step with batch work
    in flight (`batch_in_flight`, by default: batch decodes running) takes at least it.
    Where the new prompt can never get in (more decodes than the token budget or the
    sequence slots hold), the answer is infinite.

    The replay stops at the first step that takes the total over `stop_over`: the answer
    is then a lower bound over it, which is all admission needs to know, and the replay
    stays short (behind a whole-context prompt cut to a few tokens a step it would run
    thousands of steps, hundreds of ms of the gateway's event loop). Under a target so far
    off that it has not stopped after `max_steps` steps (or MAX_REPLAY_CHUNKS requests'
    chunks), the rest is replayed in at most `max_steps` strides: a stride repeats one
    step's plan as many times as finishes the prompts in the strides left (never through
    a prompt's last chunk: that step is replayed alone), each step priced with its
    contexts as far on as they are by then (the cost is linear in them: the mean of the
    first and last step's). What it leaves out is the plan itself changing within a
    stride (chunks cut to the step limit shrink as contexts grow: it errs low)."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}")
    priced = LinearStepCost.from_dict(dict(coefficients))
    # As the engine asks it: of its start-up profile's fit (`profile`) when there is one.
    reference = LinearStepCost.from_dict(dict(profile)) if profile else priced
    replay = Replay(
        max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_cap=long_prefill_cap,
        limit=limit,
        model=priced,
        reference=reference,
        block_size=block_size,
    )
    in_flight = batch.num_seqs > 0 if batch_in_flight is None else batch_in_flight
    floor = limit.seconds if limit is not None and in_flight else 0.0
    replay.add_decodes("i", interactive, interactive=True)
    if limit is None:
        replay.add_decodes("b", batch, interactive=True)
    for i, n in enumerate(prompts_ahead):
        replay.add(f"ahead{i}", n, running=True)
    # Under the priority policy batch is planned after every interactive request and kept
    # within the step limit, so with batch in flight (each step at least the limit) its
    # decodes change nothing but the sequence slots they hold.
    if limit is not None and (not in_flight or max_num_seqs is not None):
        replay.add_decodes("b", batch, interactive=False)
    mine = replay.add("new", num_prompt_tokens, running=False)
    total = 0.0
    steps = planned = 0
    strides_from: int | None = None  # the step the strides began at
    while True:
        if strides_from is None and (steps >= max_steps or planned >= MAX_REPLAY_CHUNKS):
            strides_from = steps
        left = 0 if strides_from is None else replay.prompt_tokens_left()
        chunks = replay.step()
        planned += len(chunks)
        prompts = [c for c in chunks if c.num_to_go > 1 or not c.is_decode]
        if not prompts:
            return math.inf  # decodes alone fill every step from now on
        stride = 1
        if strides_from is not None:
            stride = _stride(prompts, left, max_steps - (steps - strides_from))
        first = StepFeatures.of_chunks((c.num_tokens, c.start_pos) for c in chunks)
        seconds = max(priced.predict(first), floor)
        if stride > 1:
            # Its last step reads every context k tokens further on; the cost is linear in
            # them, so the stride's mean step is the mean of its first and last.
            k = stride - 1
            last = StepFeatures.of_chunks(
                (c.num_tokens, c.start_pos + c.num_tokens * k) for c in chunks
            )
            seconds = (seconds + max(priced.predict(last), floor)) / 2
            replay.planner.repeat(chunks, k)
        total += seconds * stride
        if mine.num_computed_tokens >= num_prompt_tokens or total > stop_over:
            return total
        steps += 1


def _stride(prompts: Sequence[Chunk], left: int, strides_left: int) -> int:
    """How many times to repeat a step's plan, its prompt chunks `prompts`: enough to
    prefill what is `left` of the prompts in `strides_left` such strides, but never through
    a prompt's last chunk (1 where this step ends one)."""
    per_step = sum(c.num_tokens for c in prompts)
    want = math.ceil(left / (per_step * max(strides_left, 1)))
    return max(1, min(want, *(c.num_to_go // c.num_tokens for c in prompts)))


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
