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
step's own, not an estimate. Torch-free and pure: the engine and the simulator call it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
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
