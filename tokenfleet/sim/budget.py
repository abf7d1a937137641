"""The step's batch token budget as the engine asks for it, composed from harvest.py.

The same composition as EngineCore._harvest_budget (core.py imports torch, so the
simulator cannot call it): the interactive chunks the scheduler planned, the cost bound of
the batch requests that can join, and harvest_budget over what the step has left. It takes
the candidates as plain (latest start, num_tokens) pairs, so that a leap (replica.py) can
price a step further on without touching the requests.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenfleet.harvest import BatchTokenCost, StepCost, batch_token_cost, harvest_budget
from tokenfleet.step_model import StepFeatures


def batch_budget(
    model: StepCost,
    interactive_chunks: list[tuple[int, int]],
    candidates: Iterable[tuple[int, int]],
    *,
    tpot_target_s: float,
    margin: float,
    max_num_batched_tokens: int,
) -> int:
    """Batch tokens allowed beside `interactive_chunks` ((num_tokens, start_pos) each)."""
    interactive = StepFeatures()
    for num_tokens, start_pos in interactive_chunks:
        interactive += StepFeatures.of_chunk(num_tokens, start_pos)
    cost = batch_token_cost(model, candidates) if interactive_chunks else BatchTokenCost()
    return harvest_budget(
        model,
        interactive,
        cost,
        tpot_target_s=tpot_target_s,
        margin=margin,
        max_tokens=max_num_batched_tokens - sum(n for n, _ in interactive_chunks),
    )
