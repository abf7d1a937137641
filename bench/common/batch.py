"""The mixed-load benchmark's batch added straight to an engine (no gateway, no Batch API)."""

from __future__ import annotations

import time

from tokenfleet import LLM, SamplingParams
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.request import PRIORITY_BATCH
from tokenfleet.loadgen.workload import (
    RequestSpec,
    WorkloadConfig,
    build_workload,
    prompt_text,
)


def add_batch(
    llm: LLM,
    num_requests: int,
    *,
    max_model_len: int,
    prompt_len_median: int = 128,
    output_len_median: int = 32,
    length_tail: float = 1.0,
    seed: int = 0,
) -> tuple[WorkloadConfig, list[RequestSpec], int]:
    """Add the mixed-load benchmark's batch (its seeded lengths and prompt texts; the
    defaults are mixed_load's) to `llm`'s engine as batch requests b0, b1, ...: the
    workload, its batch requests and their prompt tokens."""
    workload = WorkloadConfig(
        rate=0.0,
        duration_s=1.0,
        num_batch=num_requests,
        max_model_len=max_model_len,
        prompt_len_median=prompt_len_median,
        output_len_median=output_len_median,
        length_tail=length_tail,
        seed=seed,
    )
    specs = [s for s in build_workload(workload) if s.kind == "batch"]
    prompt_tokens = 0
    for i, spec in enumerate(specs):
        ids = llm.tokenizer.encode(prompt_text(workload, spec))
        prompt_tokens += len(ids)
        params = SamplingParams(max_tokens=spec.output_len, temperature=0, ignore_eos=True)
        request = EngineCoreRequest(f"b{i}", ids, params, time.monotonic(), PRIORITY_BATCH)
        llm.engine.add_request(request)
    return workload, specs, prompt_tokens
