"""The start-up profile: synthetic steps timed on the real runner, for the step-time
model's first coefficients (step_model.py).

The plan mixes prefill chunks (16..512 tokens, at short and long context) with decode
batches (1..64 sequences at a few context lengths), most informative first, cut to the
engine's limits. Each step takes its blocks from the KV pool and gives them back before
the next one; afterwards the free queue is rotated back, so the pool is exactly as it was
(same free blocks, same order, so the first requests get the blocks they would have got).
Run it on a pool with nothing cached: taking a cached free block forgets its hash.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet.core.block_pool import BlockPool
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenfleet.policy.step_model import (
    TERMS,
    StepSample,
    fit_coefficients,
    step_features,
    step_seconds,
)

# One synthetic step: (num_tokens, start_pos) per request.
ProfileStep = list[tuple[int, int]]

# Most informative first: the first five pin every term; a later step is skipped when it
# would run past the time cap.
_PLAN: tuple[ProfileStep, ...] = (
    [(1, 15)],  # the fixed cost of a step
    [(128, 0)],
    [(1, 63)] * 32,
    [(1, 1023)] * 16,  # decodes reading a long context
    [(128, 1920)],  # a prefill chunk late in a long prompt
    [(32, 0)],
    [(1, 255)] * 64,
    [(128, 128)] + [(1, 127)] * 16,  # mixed, as continuous batching runs
    [(256, 0)],
    [(1, 63)] * 8,
    [(16, 0)],
    [(512, 0)],
)
_WARMUP: ProfileStep = [(16, 0)]  # first calls pay one-off costs; never recorded
_GREEDY = SamplingParams(max_tokens=1, temperature=0)


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def _clip(step: ProfileStep, limits: _Limits) -> ProfileStep:
    """The step cut to what the engine could schedule: contexts capped (the first request
    to the free blocks too), prefill chunks shortened to the token budget, requests
    dropped from the end. Empty when nothing is left."""
    out: ProfileStep = []
    num_tokens = num_blocks = 0
    for planned, start in step[: limits.max_num_seqs]:
        max_context = limits.max_model_len
        if not out:
            max_context = min(max_context, limits.num_free_blocks * limits.block_size)
        n = min(planned, max_context, limits.max_num_batched_tokens - num_tokens)
        start = min(start, max_context - n)
        need = _cdiv(start + n, limits.block_size)
        # A prefill chunk cut to one token would be a decode: drop it instead.
        if n < min(planned, 2) or num_blocks + need > limits.num_free_blocks:
            break
        out.append((n, start))
        num_tokens += n
        num_blocks += need
    return out


@dataclass(frozen=True)
class _Limits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    num_free_blocks: int
    block_size: int


def profile_plan(
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    num_free_blocks: int,
    block_size: int,
) -> list[ProfileStep]:
    """The default plan cut to the engine's limits, warm-up first, without repeats."""
    limits = _Limits(
        max_num_batched_tokens, max_num_seqs, max_model_len, num_free_blocks, block_size
    )
    warmup = _clip(_WARMUP, limits)
    if not warmup:
        return []
    plan: list[ProfileStep] = []
    for step in _PLAN:
        clipped = _clip(step, limits)
        if clipped and clipped not in plan:
            plan.append(clipped)
    return [warmup, *plan]


def profile_step_time(
    execute: Callable[[SchedulerOutput], Any],
    pool: BlockPool,
    block_size: int,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    max_seconds: float,
) -> list[StepSample]:
    """The default plan, cut to these limits and the pool's free blocks, timed."""
    plan = profile_plan(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        num_free_blocks=pool.num_free_blocks,
        block_size=block_size,
    )
    return run_profile(execute, pool, block_size, plan, max_seconds=max_seconds)


def run_profile(
    execute: Callable[[SchedulerOutput], Any],
    pool: BlockPool,
    block_size: int,
    plan: Sequence[ProfileStep],
    *,
    max_seconds: float,
    clock: Callable[[], float] = time.perf_counter,
) -> list[StepSample]:
    """Time `execute` on each planned step after the first (a warm-up).

    A step is skipped when the profile so far predicts it would end past `max_seconds`.
    """
    samples: list[StepSample] = []
    num_free = pool.num_free_blocks
    num_taken = 0  # blocks moved from the head of the free queue to its tail
    began = clock()
    for i, step in enumerate(plan):
        features = step_features(_scheduler_output(step, [[] for _ in step]))
        if len(samples) >= len(TERMS):  # the first steps cover every term
            coef = fit_coefficients(samples)
            if clock() - began + step_seconds(coef.tolist(), features) > max_seconds:
                continue
        sizes = [_cdiv(start + n, block_size) for n, start in step]
        blocks = pool.get_new_blocks(sum(sizes))
        ids = [b.block_id for b in blocks]
        offsets = itertools.accumulate(sizes, initial=0)
        block_ids = [ids[o : o + k] for o, k in zip(offsets, sizes, strict=False)]
        began_step = clock()
        try:
            execute(_scheduler_output(step, block_ids))
        finally:
            seconds = clock() - began_step
            # Freed in the order taken, so the free queue stays a rotation of itself.
            pool.free_blocks(blocks)
            num_taken += len(blocks)
        if i > 0:
            samples.append(StepSample(features, seconds))
    # Rotate the free queue back to the order it started in.
    for _ in range(-num_taken % num_free if num_free else 0):
        pool.free_queue.append(pool.free_queue.popleft())
    return samples


def _scheduler_output(step: ProfileStep, block_ids: list[list[int]]) -> SchedulerOutput:
    scheduled = [
        ScheduledRequest(
            req_id=f"step-profile-{j}",
            token_ids=[0] * n,
            start_pos=start,
            new_block_ids=ids,
            new_table=True,  # each step's tables afresh (the ids recur)
            sample=True,
            sampling_params=_GREEDY,
        )
        for j, ((n, start), ids) in enumerate(zip(step, block_ids, strict=True))
    ]
    return SchedulerOutput(scheduled, frozenset(), ())
