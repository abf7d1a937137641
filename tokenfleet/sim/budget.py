"""The priority policy's step budgets, as the engine plans them.

A step is planned by harvest.PriorityBudgets, the engine's own planner (replica.py builds
one per step with from_config, as core.py does): interactive prompts beside streams cut to
the TPOT limit, and batch within the harvest budget. `batch_decodes_fit` asks the same
harvest_budget about a step further on, from plain numbers, so that a leap (replica.py)
can tell whether the batch decodes would still all be let in without touching the
requests.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenfleet.policy.harvest import harvest_budget
from tokenfleet.policy.step_model import StepCost, StepFeatures


def batch_decodes_fit(
    model: StepCost,
    interactive_starts: list[int],
    batch_starts: list[int],
    waiting_chunks: Iterable[tuple[int, int]],
    *,
    tpot_target_s: float,
    margin: float,
    max_num_batched_tokens: int,
    batch_step_limit_s: float | None = None,
) -> bool:
    """Whether a step of interactive decodes from `interactive_starts` lets in every batch
    decode from `batch_starts`, the waiting batch requests' chunks after them."""
    interactive = StepFeatures()
    for start in interactive_starts:
        interactive += StepFeatures.of_chunk(1, start)
    chunks = [(start, 1) for start in batch_starts]
    chunks.extend(waiting_chunks)
    budget = harvest_budget(
        model,
        interactive,
        chunks,
        tpot_target_s=tpot_target_s,
        margin=margin,
        max_tokens=max_num_batched_tokens - len(interactive_starts),
        batch_step_limit_s=batch_step_limit_s,
    )
    return budget >= len(batch_starts)
