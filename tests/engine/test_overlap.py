"""The overlap (EngineConfig.overlap): step n+1 is planned while step n runs, its decode
rows fed the tokens step n samples once they are known. Outputs are those of the engine
without it, token for token, with the real model: greedy and seeded sampling with
penalties, constrained rows, stop tokens, chunked prefill, preemption and aborts while a
step runs. A request that ends in step n costs step n+1 at most one row, whose token is
never sent; one that ends by length costs none. (Greedy against transformers with the
overlap on: tests/runner/test_greedy_vs_transformers.py, which runs both ways.)"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
from support.engine_streams import Stream, run_streams

from tokenfleet import SamplingParams
from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.sampling_params import Constraint
from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.forward import overlap_wanted
from tokenfleet.models.config import ModelConfig
from tokenfleet.policy.step_model import StepModelConfig

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rust on an old bicycle.",
    "List three prime numbers greater than 50.",
    "Explain in one sentence why the sky is blue.",
    "Give me a name for a pet turtle that loves jazz.",
    "Describe the largest city of Japan as JSON.",
]

_ids = itertools.count()


def _core(model_folder: Path, *, overlap: bool, num_blocks: int = 256, **sched: Any) -> EngineCore:
    kv_bytes = ModelConfig.from_folder(model_folder).kv_bytes_per_token(4) * BLOCK_SIZE
    config = EngineConfig(
        model=str(model_folder),
        cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=kv_bytes * num_blocks),
        scheduler=SchedulerConfig(**sched),
        overlap=overlap,
    )
    return EngineCore(config, step_model_config=StepModelConfig(profile=False))


def _fixed_core(model_folder: Path, **fields: Any) -> EngineCore:
    config = EngineConfig(model=str(model_folder), runner="fixed", **fields)
    return EngineCore(config, step_model_config=StepModelConfig(profile=False))


def _request(
    prompt: list[int], params: SamplingParams, req_id: str | None = None
) -> EngineCoreRequest:
    return EngineCoreRequest(req_id or f"o{next(_ids)}", prompt, params, 0.0)


@pytest.fixture(scope="module")
def prompts(model_folder: Path) -> list[list[int]]:
    tok = Tokenizer(model_folder)
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS
    ]


def _mixed(prompts: list[list[int]], stop_token: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded with penalties, constrained (greedy and seeded), a stop token, and
    max_tokens cuts: every kind of row the overlap must keep exact."""
    greedy = SamplingParams(max_tokens=24, temperature=0)
    seeded = SamplingParams(
        max_tokens=24,
        temperature=0.9,
        top_p=0.9,
        seed=11,
        presence_penalty=0.7,
        frequency_penalty=0.3,
    )
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    constrained = SamplingParams(max_tokens=48, temperature=0, constraint=schema)
    constrained_seeded = SamplingParams(max_tokens=48, temperature=0.8, seed=3, constraint=schema)
    stopped = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token])
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    kinds = [greedy, seeded, constrained, constrained_seeded, stopped, short]
    return [(p, kinds[i % len(kinds)]) for i, p in enumerate(prompts * 2)]


def _streams(core: EngineCore, work: list[tuple[list[int], SamplingParams]]) -> list[Stream]:
    return run_streams(core, [_request(p, params) for p, params in work])


def test_overlap_gives_the_same_outputs_as_steps_one_after_another(
    model_folder: Path, prompts: list[list[int]]
) -> None:
    """Twelve requests of six kinds in one batch, chunked prefill (a 64-token budget):
    every stream equal token for token with the overlap on and off, and the overlap
    really planned ahead, dropping at most one row of each request that ended by a token
    (none of those that ended by length)."""
    tok = Tokenizer(model_folder)
    cores = {o: _core(model_folder, overlap=o, max_num_batched_tokens=64) for o in (True, False)}
    # The stop token: the greedy answer's 5th token, for the prompt that gets stop_token_ids.
    (plain,) = _streams(cores[False], [(prompts[4], SamplingParams(max_tokens=5, temperature=0))])
    stop_token = plain.tokens[4]
    work = _mixed(prompts, stop_token)
    streams = {o: _streams(core, work) for o, core in cores.items()}
    assert streams[True] == streams[False]
    reasons = [s.finish_reason for s in streams[True]]
    assert {"stop", "length"} <= set(reasons) and all(s.error is None for s in streams[True])
    assert any(s.stop_token_id == stop_token for s in streams[True])
    for s, (_, params) in zip(streams[True], work, strict=True):
        if params.constraint is not None and s.finish_reason == "stop":
            json.loads(tok.decode(s.tokens))  # whole JSON
    on, off = cores[True], cores[False]
    assert on.num_steps_planned_ahead >= on.scheduler.num_steps - 2 > 10
    assert off.num_steps_planned_ahead == 0
    ended_by_token = reasons.count("stop")
    assert 0 < on.scheduler.num_rows_dropped <= ended_by_token


def test_preemption_while_a_step_runs_keeps_outputs_exact(
    model_folder: Path, prompts: list[list[int]]
) -> None:
    """A KV cache of 14 blocks for 12 requests: requests are preempted by plans made
    while their previous step still runs; the outputs are those of the engine without the
    overlap, and every block comes back."""
    work = [(p, SamplingParams(max_tokens=24, temperature=0)) for p in prompts * 2]
    cores = {o: _core(model_folder, overlap=o, num_blocks=14) for o in (True, False)}
    streams = {o: _streams(core, work) for o, core in cores.items()}
    assert streams[True] == streams[False]
    assert cores[True].scheduler.num_preemptions > 0
    assert cores[True].num_steps_planned_ahead > 0


def test_an_abort_while_a_step_runs_ends_the_request_there_and_spares_the_others(
    model_folder: Path, prompts: list[list[int]]
) -> None:
    """Aborted between steps, while the step planned ahead with its row runs: one abort
    output, no token after it; the others go on exactly as in a run without the abort."""
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = _streams(_core(model_folder, overlap=False), [(p, greedy) for p in prompts[:3]])
    core = _core(model_folder, overlap=True)
    requests = [_request(p, greedy) for p in prompts[:4]]
    for r in requests:
        core.add_request(r)
    victim = requests[3].req_id
    tokens: dict[str, list[int]] = {r.req_id: [] for r in requests}
    ends: dict[str, list[str]] = {r.req_id: [] for r in requests}
    for step in itertools.count():
        if step == 4:
            assert core.step_in_flight  # its row runs now
            core.abort([victim])
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            tokens[out.req_id].extend(out.new_token_ids)
            if out.finished:
                ends[out.req_id].append(out.finish_reason or "")
    assert ends[victim] == ["abort"] and len(tokens[victim]) == 4
    assert [tokens[r.req_id] for r in requests[:3]] == [s.tokens for s in alone]
    assert core.scheduler.num_rows_dropped == 1
    assert core.kv.pool.num_used_blocks == 0


@pytest.mark.fake("the fixed runner")
def test_a_request_id_reused_while_its_old_row_runs_gets_none_of_its_tokens_fixed_runner(
    model_folder: Path,
) -> None:
    """An id aborted and added again between steps, while the step planned ahead holds the
    old request's row: the new request's stream is its own, max_tokens tokens exactly."""
    core = _fixed_core(model_folder)
    params = SamplingParams(max_tokens=5, temperature=0)
    core.add_request(_request([5, 6, 7], params, "same"))
    first = core.step().outputs
    assert [len(o.new_token_ids) for o in first] == [1] and core.step_in_flight
    core.abort(["same"])
    core.add_request(_request([8, 9], params, "same"))
    tokens, ends = [], []
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.extend(out.new_token_ids)
            ends.append(out.finish_reason)
    assert ends.count("abort") == 1 and ends.count("length") == 1
    assert len(tokens) == 5
    assert core.scheduler.num_rows_dropped == 1


@pytest.mark.fake("the fixed runner")
def test_a_request_ending_by_length_costs_the_step_ahead_no_row_fixed_runner(
    model_folder: Path,
) -> None:
    """max_tokens is known ahead: a request whose last token is in flight is not planned
    again. One ending by a stop token costs exactly the one row the overlap allows."""
    core = _fixed_core(model_folder)
    token = core.runner.token_id  # type: ignore[union-attr]
    lengths = [_request([3, 4, 5], SamplingParams(max_tokens=n, temperature=0)) for n in (1, 2, 7)]
    streams = run_streams(core, lengths)
    assert [len(s.tokens) for s in streams] == [1, 2, 7]
    assert core.scheduler.num_rows_dropped == 0 and core.num_steps_planned_ahead > 0
    stops = [
        _request([3, 4, 5], SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[token]))
        for _ in range(3)
    ]
    streams = run_streams(core, stops)
    assert [s.tokens for s in streams] == [[token]] * 3
    # The step planned ahead holds their three rows; the next call waits for it and sends
    # none of its tokens.
    assert core.step_in_flight and not core.has_step_work()
    assert core.step().outputs == []
    assert core.scheduler.num_rows_dropped == 3 and not core.step_in_flight


def test_the_overlap_left_unset_is_on_for_the_fixed_runner_only() -> None:
    """EngineConfig.overlap None: on for the fixed runner (its forward leaves the host
    alone), off for the model on a CPU or an accelerator (measured slower there); set, as
    set."""
    cores = len(os.sched_getaffinity(0))
    decide = overlap_wanted
    assert decide(EngineConfig(runner="fixed", num_threads=cores))
    assert not decide(EngineConfig(device="cuda", num_threads=1))
    assert not decide(EngineConfig(num_threads=1))
    assert not decide(EngineConfig(num_threads=cores))
    assert not decide(EngineConfig(overlap=False, runner="fixed"))
    assert decide(EngineConfig(overlap=True, num_threads=cores))
