"""Admission's replay of the engine's queue (Replay) and the time to first token it
predicts (predict_ttft): the Scheduler's token split, shared with it (core/planning.py,
on lengths alone: a cache that never runs short and never hits), within harvest.py's
prompt and batch budgets under the priority policy (a StepLimit), each step priced by the
step-time model (step_model.py). admission.py's AdmissionControl asks it for every
interactive prompt, on the gateway's event loop.

The decodes at the head of the interactive class are folded into counts (Replay's
`fold`): each of them takes exactly one token a step, first, in every step (nothing
finishes in the replay, and no interactive request is ever preempted in it: the cache
never runs short, and only a less urgent class gives up sequence slots), so the rule is
asked of the others alone, on the step's token and sequence budgets less theirs, and
harvest's budgets price the step with their features added. One of them stays a request,
so that the rule and harvest see the class decoding. Where they fill the step's tokens no
prompt advances and the answer is infinite either way. A faster evaluation of the same
rule, not a second one: tests/policy/test_admission_vs_scheduler.py holds the folded
replay's steps and predictions equal to the plain replay's and the Scheduler's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import cast

from tokenfleet.config import CacheConfig, SchedulerConfig
from tokenfleet.core.planning import Chunk, LengthPlanner, LengthRequest
from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from tokenfleet.policy.harvest import batch_budget, prefill_budget_within
from tokenfleet.policy.step_model import LinearStepCost, StepCost, StepFeatures

# predict_ttft replays this many steps one by one, then at most as many strides of several
# alike steps (a few ms of the gateway's event loop, where every stream's events wait; at
# the default targets it stops sooner). A step plans every running request: the strides
# begin sooner once the steps so far have planned this many requests' chunks in all
# (folded decodes included, so that folding changes no prediction).
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


@dataclass(frozen=True, slots=True)
class _Plus:
    """`model` pricing every step with `extra` (the folded decodes) added: a StepCost."""

    model: StepCost
    extra: StepFeatures

    def predict(self, features: StepFeatures) -> float:
        return self.model.predict(features + self.extra)


class Replay:
    """The engine's queue as admission knows it, planned step by step as the engine plans
    it: LengthPlanner's token split (the Scheduler's rule) and, under a `limit` (the
    priority policy), harvest's prefill and batch budgets priced by `model` (its
    target_reachable by `reference`, by default `model`), as PriorityBudgets gives them.
    `max_num_seqs` None: no limit on the sequences in a step; `batch_step_limit_s`: the
    engine's, for steps of batch alone (the gateway is not told it: None). `fold`: the
    interactive class's head decodes but one are counts (the module's fold), not in
    step()'s chunks: features() and num_folded count them."""

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
        fold: bool = False,
    ) -> None:
        if limit is not None and model is None:
            raise ValueError("a step limit needs a step-time model to price the budgets")
        self.config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=UNLIMITED_SEQS if max_num_seqs is None else max_num_seqs,
            long_prefill_token_threshold=long_prefill_cap,
        )
        self.planner = LengthPlanner(self.config)  # its budgets: the config's less the fold's
        self.limit, self.model, self.reference = limit, model, reference
        self.block_size, self.batch_step_limit_s = block_size, batch_step_limit_s
        self.fold = fold
        # The folded decodes: how many, and the KV tokens they read in the next step (in
        # the step last planned: stepped_kv).
        self.num_folded = self.folded_kv = self.stepped_kv = 0

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
        even split of what they read in all; with `fold`, those it can fold as counts
        (the first stays a request where the class has no decode yet)."""
        n = decodes.num_seqs
        if not n:
            return
        base, extra = divmod(max(decodes.num_kv_tokens - n, 0), n)
        i = 0
        if self.fold and interactive and self._all_decoding():
            if not self.planner.running:
                self._add_decode(prefix, 0, base + (extra > 0))
                i = 1
            folded = min(n - i, self._fold_room())
            if folded > 0:
                # Contexts i..i+folded-1: base each, one more for those below `extra`.
                ones = max(0, min(i + folded, extra) - i)
                self._grow_fold(folded, folded * (base + 1) + ones)
                i += folded
        for j in range(i, n):
            self._add_decode(prefix, j, base + (j < extra), interactive=interactive)

    def _add_decode(self, prefix: str, i: int, context: int, *, interactive: bool = True) -> None:
        self.add(
            f"{prefix}{i}",
            context + 1,
            running=True,
            num_computed_tokens=context,
            num_prompt_tokens=context,
            interactive=interactive,
        )

    def _all_decoding(self) -> bool:
        """Whether every running request so far is an interactive decode."""
        return all(
            r.is_interactive and cast(LengthRequest, r).decoding for r in self.planner.running
        )

    def _fold_room(self) -> int:
        """How many more decodes may be folded: the planner keeps a token and a sequence
        slot at least (the decode left a request)."""
        config = self.config
        return min(config.max_num_batched_tokens, config.max_num_seqs) - 1 - self.num_folded

    def _grow_fold(self, num: int, kv: int) -> None:
        self.num_folded += num
        self.folded_kv += kv
        config = self.config
        self.planner.config = replace(
            config,
            max_num_batched_tokens=config.max_num_batched_tokens - self.num_folded,
            max_num_seqs=config.max_num_seqs - self.num_folded,
        )

    def _fold_head(self) -> None:
        """Fold the running interactive decodes that follow the head one with nothing but
        decodes before them (prompts ahead that have become decodes)."""
        running = self.planner.running
        if not running or not running[0].is_interactive:
            return
        if not cast(LengthRequest, running[0]).decoding:
            return
        end, room, kv = 1, self._fold_room(), 0
        while end <= room and end < len(running):
            request = cast(LengthRequest, running[end])
            if not (request.is_interactive and request.decoding):
                break
            kv += request.num_computed_tokens + 1
            end += 1
        if end > 1:
            del running[1:end]
            self._grow_fold(end - 1, kv)

    def step(self) -> list[Chunk]:
        """Plan the next step and commit it: its chunks, in running order (the folded
        decodes' not among them)."""
        if self.fold:
            self._fold_head()
        self.stepped_kv = self.folded_kv
        self.folded_kv += self.num_folded
        planner = self.planner
        if self.limit is None:
            return planner.step()
        limit, model = self.limit, self.model
        assert model is not None
        reference = self.reference or model
        if self.num_folded:
            model = _Plus(model, StepFeatures(0, self.num_folded, self.stepped_kv, 0))
        max_tokens = planner.config.max_num_batched_tokens  # what the folded decodes leave
        max_num_seqs = self.config.max_num_seqs
        prefill = prefill_budget_within(
            model,
            planner.running,
            planner.waiting,
            limit_s=limit.seconds,
            tpot_target_s=limit.target_seconds,
            max_num_seqs=max_num_seqs,
            block_size=self.block_size,
            max_tokens=max_tokens,
            min_tokens=limit.min_prefill_chunk,
            reference=reference,
        )

        def batch(interactive_chunks: list[tuple[int, int]]) -> int:
            return batch_budget(
                model,
                interactive_chunks,
                planner.running,
                planner.waiting,
                limit_s=limit.seconds,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_tokens,
                block_size=self.block_size,
                batch_step_limit_s=self.batch_step_limit_s,
            )

        return planner.step(batch_token_budget=batch, prefill_token_budget=prefill)

    def features(self, chunks: Sequence[Chunk], later: int = 0) -> StepFeatures:
        """The features of the step last planned, its `chunks` (step()'s) and the folded
        decodes; with `later`, of the same plan that many steps on (every context further)."""
        real = StepFeatures.of_chunks(
            (c.num_tokens, c.start_pos + c.num_tokens * later) for c in chunks
        )
        if not self.num_folded:
            return real
        return real + StepFeatures(0, self.num_folded, self.stepped_kv + self.num_folded * later, 0)

    def repeat(self, chunks: Sequence[Chunk], times: int) -> None:
        """Commit the step last planned, its `chunks`, `times` more times
        (LengthPlanner.repeat), the folded decodes with it."""
        self.planner.repeat(chunks, times)
        self.folded_kv += self.num_folded * times

    def prompt_tokens_left(self) -> int:
        """The tokens still to compute of every request not decoding (prompts)."""
        planner = self.planner
        return sum(
            r.num_tokens - r.num_computed_tokens
            for r in chain(planner.running, planner.waiting)
            if not cast(LengthRequest, r).decoding
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
    fold: bool = True,
) -> float:
    """Seconds until a new interactive prompt of `num_prompt_tokens` is prefilled, behind
    the interactive `prompts_ahead` (oldest first) and with the given running decodes,
    as Replay plans it (`fold`: its decodes folded, the same answer faster).
    `long_prefill_cap` is the scheduler's long_prefill_token_threshold; `max_num_seqs` and
    `block_size` the engine's, where known.

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
        fold=fold,
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
    # decodes change nothing but the sequence slots they hold, and those only where the
    # new prompt finds none free (folded: left out where it does).
    if limit is not None and (not in_flight or max_num_seqs is not None):
        num_seqs = interactive.num_seqs + batch.num_seqs + len(prompts_ahead) + 1
        if not (fold and in_flight and max_num_seqs is not None and num_seqs <= max_num_seqs):
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
        planned += len(chunks) + replay.num_folded
        prompts = [c for c in chunks if c.num_to_go > 1 or not c.is_decode]
        if not prompts:
            return math.inf  # decodes alone fill every step from now on
        stride = 1
        if strides_from is not None:
            stride = _stride(prompts, left, max_steps - (steps - strides_from))
        seconds = max(priced.predict(replay.features(chunks)), floor)
        if stride > 1:
            # Its last step reads every context k tokens further on; the cost is linear in
            # them, so the stride's mean step is the mean of its first and last.
            k = stride - 1
            seconds = (seconds + max(priced.predict(replay.features(chunks, k)), floor)) / 2
            replay.repeat(chunks, k)
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
