"""The engine's report with each step (SchedulerStats), read off its scheduler and KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenfleet.core.engine_api import SchedulerStats
from tokenfleet.core.request import PRIORITY_INTERACTIVE, Request

if TYPE_CHECKING:
    from tokenfleet.engine.core import EngineCore


def engine_stats(core: EngineCore) -> SchedulerStats:
    """What the engine reports with each step (SchedulerStats): counts by class, the KV
    cache, the step-time model, the interactive prefill still to run."""
    errors = core.step_model.prediction_error_quantiles((0.5, 0.99))
    scheduler = core.scheduler
    batch_ids = core.fcfs_batch_ids

    def interactive(request: Request) -> bool:
        if batch_ids:
            return request.req_id not in batch_ids
        return request.is_interactive

    if core.fcfs_batch_ids:  # one scheduling class: count by the class each came as
        batch = core.fcfs_batch_ids
        num_running_interactive = sum(r.req_id not in batch for r in scheduler.running)
        num_waiting_interactive = sum(r.req_id not in batch for r in scheduler.waiting)
    else:
        num_running_interactive = sum(r.is_interactive for r in scheduler.running)
        num_waiting_interactive = sum(
            scheduler.waiting.num_waiting(p)
            for p in scheduler.waiting.priorities
            if p <= PRIORITY_INTERACTIVE
        )
    # Requests waiting for their constraint's compile count as waiting.
    num_waiting = len(scheduler.waiting) + len(core.compiling)
    num_waiting_interactive += sum(interactive(r) for r in core.compiling.requests())

    prefill_left: list[int] = []
    decoding = {"interactive": 0, "batch": 0}
    decode_kv = {"interactive": 0, "batch": 0}
    for request in scheduler.running:
        left = request.num_tokens - request.num_computed_tokens
        if request.num_computed_tokens < request.num_prompt_tokens:
            if interactive(request) and len(prefill_left) < _PREFILL_LEFT_MAX:
                prefill_left.append(left)
        else:
            cls = "interactive" if interactive(request) else "batch"
            decoding[cls] += 1
            decode_kv[cls] += request.num_computed_tokens
    for request in scheduler.waiting:
        if len(prefill_left) >= _PREFILL_LEFT_MAX:
            break
        if interactive(request):
            prefill_left.append(request.num_tokens - request.num_computed_tokens)
    preempted = scheduler.num_preemptions_by_priority
    num_preempted_interactive = sum(n for p, n in preempted.items() if p <= PRIORITY_INTERACTIVE)
    return SchedulerStats(
        num_running=len(core.scheduler.running),
        num_waiting=num_waiting,
        num_kv_blocks_used=core.kv.pool.num_used_blocks,
        num_kv_blocks_total=core.kv.pool.num_blocks,
        num_prefix_query_tokens=core.kv.num_prefix_queries,
        num_prefix_hit_tokens=core.kv.num_prefix_hits,
        num_preemptions=core.scheduler.num_preemptions,
        num_steps=core.scheduler.num_steps,
        step_time_error_p50=None if errors is None else errors[0],
        step_time_error_p99=None if errors is None else errors[1],
        step_time_coefficients=core.step_model.coefficients,
        step_time_profile=core.step_model.profile_coefficients,
        num_running_by_class=_by_class(num_running_interactive, len(scheduler.running)),
        num_waiting_by_class=_by_class(num_waiting_interactive, num_waiting),
        num_preemptions_by_class=_by_class(num_preempted_interactive, sum(preempted.values())),
        num_kv_blocks_reserved_interactive=scheduler.reserve_blocks,
        batch_token_budget=core.last_batch_token_budget,
        ttft_sum_s_by_class=dict(core.ttft_sum_s),
        ttft_count_by_class=dict(core.ttft_count),
        interactive_prefill_left=prefill_left,
        num_decoding_by_class=decoding,
        decode_kv_tokens_by_class=decode_kv,
    )


_PREFILL_LEFT_MAX = 64  # SchedulerStats.interactive_prefill_left's length at most


def _by_class(num_interactive: int, num_all: int) -> dict[str, int]:
    return {"interactive": num_interactive, "batch": num_all - num_interactive}
