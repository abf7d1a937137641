"""The harvest budget: how many batch tokens may join a step beside interactive traffic.

While interactive streams run, every step is a token of theirs, so a step may only grow
while its predicted time stays within the TPOT target less a margin:

    predict(interactive part) + once + budget * per_token  <=  tpot_target * (1 - margin)

`per_token` and `once` bound what batch chunks can add (batch_token_cost), so no step the
scheduler builds inside the budget is predicted over the limit. When the
interactive part alone is over the limit, batch gets nothing (interactive is never
held back); with no interactive work in the step, batch gets every token left.

The scheduler asks for the budget once it has planned the interactive classes
(`Scheduler.schedule(batch_token_budget=callable)`), so the interactive part is the
step's own, not an estimate.

The same bound protects streams from interactive prompts too (prefill_budget): while
interactive requests decode, the prompts still being prefilled share a token budget that
keeps decodes + prompt chunks within the limit, so a long prompt arriving among streams
is cut into chunks instead of stalling them for a whole 512-token chunk. It never goes
below a floor (`min_tokens`), so a prompt always advances: where even a one-token chunk
of it is predicted over the limit (a prompt late in a long context, on slow hardware),
the floor decides between its TTFT and the streams' gap. Torch-free and pure: the engine
and the simulator call it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice, takewhile
from typing import Protocol

from tokenfleet.request import Request
from tokenfleet.step_model import StepFeatures


class StepCost(Protocol):
    """A step-time model: seconds for a step with these features (StepTimeModel).

    Assumed non-decreasing in every feature, as a fit with non-negative coefficients is.
    """

    def predict(self, features: StepFeatures) -> float: ...


def step_time_limit(tpot_target_s: float, margin: float) -> float:
    """The most seconds a step beside interactive streams may be predicted to take."""
    return tpot_target_s * (1 - margin)


def chunk_cost(model: StepCost, num_tokens: int, start_pos: int) -> float:
    """Seconds one request's chunk adds to a step (the step's fixed cost left out)."""
    return model.predict(StepFeatures.of_chunk(num_tokens, start_pos)) - model.predict(
        StepFeatures()
    )


@dataclass(frozen=True, slots=True)
class BatchTokenCost:
    """An upper bound on what batch tokens add to a step: `per_token` seconds each, plus
    `once` for the one chunk the budget may cut short."""

    per_token: float = 0.0
    once: float = 0.0


def batch_token_cost(model: StepCost, requests: Iterable[tuple[int, int]]) -> BatchTokenCost:
    """The cost bound of any chunks these requests may be given in one step.

    `requests` are (latest start, num_tokens): a chunk starts at or before the first
    (num_computed_tokens, or the longest prefix cache hit a waiting request could have)
    and ends at or before the second, so its context is at most num_tokens (L).
    A request with one token to go runs as a decode: c + d*L. A whole chunk of n >= 2
    tokens costs b + d*context/n + e*context <= b + d*L/2 + e*L a token, half a 2-token
    chunk's cost at context L. The budget cuts at most one chunk short (nothing is
    scheduled after it), to as little as one token run as a decode: its n tokens cost at
    most n*(b + e*L) + c + d*L, the per-token bound plus `once`. All grow with L, so the
    largest L of each kind bounds every request.
    """
    max_decode_context = 0  # one token to go
    max_prefill_context = 0  # two or more
    for start, num_tokens in requests:
        if num_tokens - start >= 2:
            max_prefill_context = max(max_prefill_context, num_tokens)
        else:
            max_decode_context = max(max_decode_context, num_tokens)
    per_token = once = 0.0
    if max_decode_context:
        per_token = chunk_cost(model, 1, max_decode_context - 1)
    if max_prefill_context:
        per_token = max(per_token, chunk_cost(model, 2, max_prefill_context - 2) / 2)
        once = chunk_cost(model, 1, max_prefill_context - 1)
    return BatchTokenCost(per_token, once)


def batch_candidates(
    running: Iterable[Request], waiting: Iterable[Request], max_num_seqs: int, block_size: int
) -> Iterator[tuple[int, int]]:
    """(latest start, num_tokens) of every batch request that can join the coming step:
    the running ones, and the first `max_num_seqs` waiting ones in pop order (a step
    holds no more; this bounds the work on a 100,000-request queue). A waiting request
    may start after every full block but the last token's, all served from the cache."""
    for request in running:
        if not request.is_interactive:
            yield request.num_computed_tokens, request.num_tokens
    waiting_batch = (r for r in waiting if not r.is_interactive)
    for request in islice(waiting_batch, max_num_seqs):
        num_tokens = request.num_tokens
        yield (num_tokens - 1) // block_size * block_size, num_tokens


def harvest_budget(
    model: StepCost,
    interactive: StepFeatures,
    cost: BatchTokenCost,
    *,
    tpot_target_s: float,
    margin: float,
    max_tokens: int,
) -> int:
    """The batch token budget of a step whose interactive part is `interactive`.

    `cost` bounds what batch tokens add (batch_token_cost); `max_tokens` is what the
    step's token budget leaves after the interactive part. No interactive work: all of
    max_tokens (throughput first). Otherwise the most tokens whose bound keeps the
    predicted step within step_time_limit(), 0 when interactive alone exceeds it.
    """
    if interactive == StepFeatures():
        return max_tokens
    spare = step_time_limit(tpot_target_s, margin) - model.predict(interactive) - cost.once
    if spare < 0:
        return 0
    if cost.per_token <= 0:
        return max_tokens
    budget = min(math.floor(spare / cost.per_token), max_tokens)
    while budget > 0 and budget * cost.per_token > spare:  # the division rounded up
        budget -= 1
    return budget


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
) -> int | None:
    """The token budget of a step's interactive prompt chunks, or None for no cap.

    No cap unless interactive requests decode this step and others wait for (part of)
    their prompt. Otherwise the prompts are priced in the order the scheduler serves them
    (running ones from where they are, then the first `max_num_seqs` waiting ones): each
    gets the most tokens that keep the predicted step within step_time_limit(), and the
    next one is priced only if the one before could take all it has to go. A waiting
    request is priced from its latest possible start (after its cached full blocks), the
    dearest, but may take its whole prompt. At least `min_tokens`, at most `max_tokens`.
    """
    step = StepFeatures()
    num_decodes = 0
    prompts: list[tuple[int, int]] = []  # (start, most tokens it can take)
    for request in running:
        if not request.is_interactive:
            continue
        num_to_go = request.num_tokens - request.num_computed_tokens
        if num_to_go == 1:
            step += StepFeatures.of_chunk(1, request.num_computed_tokens)
            num_decodes += 1
        elif num_to_go > 1:
            prompts.append((request.num_computed_tokens, num_to_go))
    if not num_decodes:
        return None
    # Pop order puts interactive first: stop at the first batch request, not scan them.
    waiting_interactive = takewhile(lambda r: r.is_interactive, waiting)
    for request in islice(waiting_interactive, max_num_seqs):
        num_tokens = request.num_tokens
        prompts.append(((num_tokens - 1) // block_size * block_size, num_tokens))
    if not prompts:
        return None
    limit = step_time_limit(tpot_target_s, margin)
    budget = 0
    for start, num_to_go in prompts:
        n = _most_tokens(
            model, step, start, min(num_to_go, max_tokens - num_decodes - budget), limit
        )
        budget += n
        if n < num_to_go:
            break
        step += StepFeatures.of_chunk(n, start)
    return max(0, min(max(budget, min_tokens), max_tokens - num_decodes))


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
