"""The harvest budget: how many batch tokens may join a step beside interactive traffic.

While interactive streams run, every step is a token of theirs, so a step may only grow
while its predicted time stays within the TPOT target less a margin:

    predict(interactive part + batch chunks)  <=  tpot_target * (1 - margin)

The scheduler asks for the budget once it has planned the interactive classes
(`Scheduler.schedule(batch_token_budget=callable)`), so the interactive part is the
step's own, not an estimate. The batch chunks are priced in the order the scheduler will
hand the budget out (its running batch requests, then the waiting ones in pop order),
each taking the most tokens that keep the step within the limit, so a long prompt's
chunk is priced at its real context and reads that context once, not once a token. A
waiting request is priced from its latest possible start (after its cached full blocks),
the dearest, but may take its whole prompt. When the interactive part alone is over the
limit, batch gets nothing (interactive is never held back); with no interactive work in
the step, batch gets every token left (throughput first), or, with a batch step limit,
what keeps the step within it: an interactive request that arrives meanwhile waits for
the step in progress, so on hardware where a full step is long next to the TTFT target
the limit trades a little batch throughput (the step's fixed cost is paid more often)
for a shorter wait.

The same packing protects streams from interactive prompts too (prefill_budget): while
interactive requests decode, the prompts still being prefilled share a token budget that
keeps decodes + prompt chunks within the limit, so a long prompt arriving among streams
is cut into chunks instead of stalling them for a whole 512-token chunk. It never goes
below one token, so a prompt always advances, even where a one-token chunk of it is
predicted over the limit (a prompt late in a long context, on slow hardware). Where the
decodes alone are over the limit, a prompt gets a floor (`min_tokens`) within the target,
and where they are over the target, the floor may add the margin's worth of time to their
step (with_floor); only where the hardware cannot meet the target at all
(target_reachable) are prompts not cut. Torch-free and pure: the engine, the simulator and
admission's replay call it. (Over 400 lines: the one packing rule and the two budgets made
with it, the batch and the prefill budget, are read together.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import accumulate, islice, takewhile
from typing import Protocol

from tokenfleet.core.request import Request
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.policy.step_model import StepCost as StepCost  # priced there; named here too
from tokenfleet.policy.step_model import StepFeatures


def step_time_limit(tpot_target_s: float, margin: float) -> float:
    """The most seconds a step beside interactive streams may be predicted to take."""
    return tpot_target_s * (1 - margin)


def batch_chunks(
    running: Iterable[Request], waiting: Iterable[Request], max_num_seqs: int, block_size: int
) -> Iterator[tuple[int, int]]:
    """(start, most tokens) of every batch request that can join the coming step, in the
    order the scheduler serves them: the running ones from where they are, then the first
    `max_num_seqs` waiting ones in pop order (a step holds no more; this bounds the work
    on a 100,000-request queue), each from after every full block but the last token's
    (all of it cached, the dearest start) yet taking up to its whole prompt."""
    for request in running:
        if not request.is_interactive:
            yield request.num_computed_tokens, request.num_tokens - request.num_computed_tokens
    waiting_batch = (r for r in waiting if not r.is_interactive)
    for request in islice(waiting_batch, max_num_seqs):
        num_tokens = request.num_tokens
        yield (num_tokens - 1) // block_size * block_size, num_tokens


def pack(
    model: StepCost,
    step: StepFeatures,
    chunks: Iterable[tuple[int, int]],
    limit_s: float,
    max_tokens: int,
) -> int:
    """The tokens that `chunks` ((start, most tokens), in serving order) add to `step`
    while its prediction stays within `limit_s`: each chunk takes the most it can, and the
    next is priced only if it took all it had. At most `max_tokens`. A run of decodes (one
    token to go each: most of a busy step) is priced in one go (_decodes_fit)."""
    total = 0
    contexts: list[int] = []  # of the decodes since the last longer chunk, not priced yet
    for start, most in chunks:
        if most == 1:
            contexts.append(start + 1)
            continue
        if contexts:
            n, step = _decodes_fit(model, step, contexts, limit_s, max_tokens - total)
            total += n
            if n < len(contexts) or total >= max_tokens:
                return total
            contexts = []
        n = _most_tokens(model, step, start, min(most, max_tokens - total), limit_s)
        total += n
        if n < most or total >= max_tokens:
            return total
        step += StepFeatures.of_chunk(n, start)
    if contexts:
        total += _decodes_fit(model, step, contexts, limit_s, max_tokens - total)[0]
    return total


def _decodes_fit(
    model: StepCost, step: StepFeatures, contexts: list[int], limit: float, room: int
) -> tuple[int, StepFeatures]:
    """How many of a run of decodes (their contexts, in serving order) join `step`, each
    taken only if the one before it was, within `limit` and at most `room`; and the step
    with them. What pricing them one by one gives, the prediction growing with each: a
    binary search over the run's prefix sums, a few predictions for the whole run."""
    sums = [0, *accumulate(contexts)]

    def with_first(m: int) -> StepFeatures:
        return step + StepFeatures(decode_seqs=m, kv_tokens_read=sums[m])

    low, high = 0, min(len(contexts), room)
    while low < high:
        mid = (low + high + 1) // 2
        if model.predict(with_first(mid)) <= limit:
            low = mid
        else:
            high = mid - 1
    return low, with_first(low)


def _most_tokens(model: StepCost, step: StepFeatures, start: int, most: int, limit: float) -> int:
    """The largest n <= most with step + a chunk of n tokens from `start` predicted within
    `limit` (0 if none): a binary search, the prediction growing with n."""
    low, high = 0, max(most, 0)
    while low < high:
        mid = (low + high + 1) // 2
        if model.predict(step + StepFeatures.of_chunk(mid, start)) <= limit:
            low = mid
        else:
            high = mid - 1
    return low


def harvest_budget(
    model: StepCost,
    interactive: StepFeatures,
    batch: Iterable[tuple[int, int]],
    *,
    tpot_target_s: float,
    margin: float,
    max_tokens: int,
    batch_step_limit_s: float | None = None,
) -> int:
    """The batch token budget of a step whose interactive part is `interactive`, with
    `batch` its batch_chunks(); `max_tokens` is what the step's token budget leaves. A
    step of batch alone is kept within `batch_step_limit_s` (None: no limit), and takes at
    least one token, so that batch always advances."""
    limit_s = step_time_limit(tpot_target_s, margin)
    return _harvest(model, interactive, batch, limit_s, max_tokens, batch_step_limit_s)


def _harvest(
    model: StepCost,
    interactive: StepFeatures,
    batch: Iterable[tuple[int, int]],
    limit_s: float,
    max_tokens: int,
    batch_step_limit_s: float | None,
) -> int:
    """harvest_budget within a step limit of `limit_s`."""
    if interactive == StepFeatures():
        if batch_step_limit_s is None:
            return max_tokens
        return max(1, pack(model, interactive, batch, batch_step_limit_s, max_tokens))
    return pack(model, interactive, batch, limit_s, max_tokens)


def batch_budget(
    model: StepCost,
    interactive_chunks: list[tuple[int, int]],
    running: Iterable[Request],
    waiting: Iterable[Request],
    *,
    limit_s: float,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    batch_step_limit_s: float | None = None,
) -> int:
    """The batch budget of a step whose interactive requests are planned as
    `interactive_chunks` ((num_tokens, start_pos)), the batch ones being those of
    `running` and `waiting` (harvest_budget, within a step limit of `limit_s`)."""
    interactive = StepFeatures.of_chunks(interactive_chunks)
    chunks = batch_chunks(running, waiting, max_num_seqs, block_size)
    max_tokens = max_num_batched_tokens - sum(n for n, _ in interactive_chunks)
    return _harvest(model, interactive, chunks, limit_s, max_tokens, batch_step_limit_s)


def prefill_budget(
    model: StepCost,
    running: Iterable[Request],
    waiting: Iterable[Request],
    *,
    max_num_seqs: int,
    block_size: int,
    tpot_target_s: float,
    margin: float,
    max_tokens: int,
    min_tokens: int,
    reference: StepCost | None = None,
) -> int | None:
    """The token budget of a step's interactive prompt chunks, or None for no cap.

    No cap unless interactive requests decode this step and others wait for (part of)
    their prompt. Otherwise the prompts (running ones, then the first `max_num_seqs`
    waiting ones, as batch_chunks() orders batch) are packed beside the decodes, and the
    budget is at least `min_tokens`, at most what the step's `max_tokens` leaves.
    """
    return prefill_budget_within(
        model,
        running,
        waiting,
        limit_s=step_time_limit(tpot_target_s, margin),
        tpot_target_s=tpot_target_s,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        reference=reference,
    )


def prefill_budget_within(
    model: StepCost,
    running: Iterable[Request],
    waiting: Iterable[Request],
    *,
    limit_s: float,
    tpot_target_s: float,
    max_num_seqs: int,
    block_size: int,
    max_tokens: int,
    min_tokens: int,
    reference: StepCost | None = None,
) -> int | None:
    """prefill_budget with the step limit given as `limit_s` (admission's StepLimit)."""
    num_decodes = kv_read = 0  # the decodes' StepFeatures, summed as of_chunk sums them
    prompts: list[tuple[int, int]] = []
    for request in running:
        if not request.is_interactive:
            continue
        num_to_go = request.num_tokens - request.num_computed_tokens
        if num_to_go == 1:
            kv_read += request.num_computed_tokens + 1
            num_decodes += 1
        elif num_to_go > 1:
            prompts.append((request.num_computed_tokens, num_to_go))
    if not num_decodes:
        return None
    decodes = StepFeatures(decode_seqs=num_decodes, kv_tokens_read=kv_read)
    # Pop order puts interactive first: stop at the first batch request, not scan them.
    waiting_interactive = takewhile(lambda r: r.is_interactive, waiting)
    for request in islice(waiting_interactive, max_num_seqs):
        num_tokens = request.num_tokens
        prompts.append(((num_tokens - 1) // block_size * block_size, num_tokens))
    if not prompts:
        return None
    if not target_reachable(reference or model, tpot_target_s, min_tokens):
        return None
    room = max(0, max_tokens - num_decodes)
    fits = pack(model, decodes, prompts, limit_s, room)
    floor = with_floor(model, decodes, prompts, fits, limit_s, tpot_target_s, min_tokens, room)
    return min(floor, room)


# How far over the TPOT target the start-up profile may price one decode beside the floor's
# chunk and the target still count as reachable: a profile of a few steps at start-up is
# noisy (the engine starts beside the gateway's own start), and the decision is a cliff.
# On an AMD EPYC, one thread, the floor's step priced 81.5 and 96.9 ms in two profiles of
# the same engine settings a minute apart; a third, at a server's start, priced it over
# the 106.7-ms target (twice the decode step), and an 8,191-token prompt then went whole
# beside three streams: 3-9 s gaps (bench/long_prompt.py, float16 KV).
REACHABLE_TOLERANCE = 1.25


def target_reachable(model: StepCost, tpot_target_s: float, min_tokens: int) -> bool:
    """Whether one stream's decode step beside the floor's chunk of a new prompt
    (`min_tokens`) fits the target, within REACHABLE_TOLERANCE. When not (a target this
    hardware cannot meet, like the reference GPU's on a CPU, or one a single decode nearly
    fills), cutting prompts would only starve them: they are not cut. (Asking of one decode
    alone let a target 5 ms above it on this CPU cut a burst's 16-token prompts to 3 tokens
    a step beside one stream: each request of the burst got its first token ~1 s after the
    one before.) When it does but the running streams alone take more (their contexts
    grew), prompts get the floor (with_floor): uncut, a chunk deep into a long prompt would
    stall every stream for seconds. The engine asks its start-up profile's fit
    (`reference`): an online fit over a window of alike steps (three streams and a
    one-token chunk, for minutes) cannot tell the step's fixed cost from the cost per
    decode, and drifted past the target (a measured run: 52 -> 133 ms in 200 steps)."""
    step = StepFeatures.of_chunks(((1, 0), (max(min_tokens, 1), 0)))
    return model.predict(step) <= tpot_target_s * REACHABLE_TOLERANCE


def with_floor(
    model: StepCost,
    step: StepFeatures,
    prompts: Iterable[tuple[int, int]],
    fits: int,
    limit_s: float,
    tpot_target_s: float,
    min_tokens: int,
    room: int,
) -> int:
    """The prompt tokens a step beside decodes takes: `fits` (what the limit leaves), and at
    least one, so that a prompt keeps moving. A chunk deep into a long prompt reads its
    whole context, so near the end of one the floor is what decides the streams' gaps; the
    margin below the target is there for the model's errors, which are largest on those
    steps (a long prompt beside three streams, float16 KV: measured over predicted p90
    1.14, p99 1.27-1.39), so while the decodes alone are within the limit the floor keeps
    to it too. (Spending the margin on the floor put the median gap at the target.)

    Where the decodes alone are over the limit (many streams on slow hardware), the floor
    is `min_tokens`, but only as many of them as keep the step within the target itself;
    where they are over the target, the floor may add the margin's worth of time (target -
    limit) to their step: one token a step would not save the streams' target, and a burst
    of prompts behind it would wait for minutes."""
    if fits >= min_tokens:
        return fits
    alone = model.predict(step)
    if alone <= limit_s:
        return max(1, fits)
    ceiling = tpot_target_s
    if alone > tpot_target_s:
        ceiling = alone + max(tpot_target_s - limit_s, 0.0)
    return max(1, min(min_tokens, pack(model, step, prompts, ceiling, room)))


class BudgetSettings(Protocol):
    """The priority policy's settings: EngineConfig's, and the simulator's ReplicaConfig's."""

    @property
    def tpot_target_s(self) -> float: ...

    @property
    def harvest_margin(self) -> float: ...

    @property
    def min_prefill_chunk(self) -> int: ...

    @property
    def batch_step_limit_s(self) -> float | None: ...


class PriorityBudgets:
    """The priority policy's budgets for one step of `scheduler`, priced by `model`: what
    the engine (core.py) and the simulator both plan a step with."""

    def __init__(
        self,
        scheduler: Scheduler,
        model: StepCost,
        *,
        block_size: int,
        tpot_target_s: float,
        margin: float,
        min_prefill_chunk: int,
        batch_step_limit_s: float | None = None,
        reference: StepCost | None = None,
    ) -> None:
        self.scheduler, self.model, self.block_size = scheduler, model, block_size
        self.tpot_target_s, self.margin = tpot_target_s, margin
        self.min_prefill_chunk = min_prefill_chunk
        self.batch_step_limit_s = batch_step_limit_s
        self.reference = reference  # for target_reachable; None: `model`
        self.last_batch_budget: int | None = None  # as the scheduler was last told

    @classmethod
    def from_config(
        cls,
        scheduler: Scheduler,
        model: StepCost,
        config: BudgetSettings,
        reference: StepCost | None = None,
    ) -> PriorityBudgets:
        """The budgets the engine and the simulator plan each step with."""
        return cls(
            scheduler,
            model,
            block_size=scheduler.kv.block_size,
            tpot_target_s=config.tpot_target_s,
            margin=config.harvest_margin,
            min_prefill_chunk=config.min_prefill_chunk,
            batch_step_limit_s=config.batch_step_limit_s,
            reference=reference,
        )

    def schedule(self, now: float) -> SchedulerOutput:
        """Plan the step: prompts beside streams cut, batch within the harvest budget."""
        return self.scheduler.schedule(
            now, batch_token_budget=self.batch_budget, prefill_token_budget=self.prefill_budget()
        )

    def prefill_budget(self) -> int | None:
        config = self.scheduler.config
        return prefill_budget(
            self.model,
            self.scheduler.running,
            self.scheduler.waiting,
            max_num_seqs=config.max_num_seqs,
            block_size=self.block_size,
            tpot_target_s=self.tpot_target_s,
            margin=self.margin,
            max_tokens=config.max_num_batched_tokens,
            min_tokens=self.min_prefill_chunk,
            reference=self.reference,
        )

    def batch_budget(self, interactive_chunks: list[tuple[int, int]]) -> int:
        """Given the step's planned interactive chunks as (num_tokens, start_pos)."""
        scheduler = self.scheduler
        config = scheduler.config
        self.last_batch_budget = batch_budget(
            self.model,
            interactive_chunks,
            scheduler.running,
            scheduler.waiting,
            limit_s=step_time_limit(self.tpot_target_s, self.margin),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=self.block_size,
            batch_step_limit_s=self.batch_step_limit_s,
        )
        return self.last_batch_budget
