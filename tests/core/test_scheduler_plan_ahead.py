"""The Scheduler planning ahead (the engine's overlap), driven in the overlap's order by the
FakeModelRunner (tests/support/fake_runner.py), whose "model" reads each context back from
the KV blocks: step n+1 is planned before step n's tokens are known, its placeholders
filled from them at launch, and n's results land after that plan. Every request's tokens
are the reference's, whatever preemption, prefix hits, stop tokens and aborts do."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fake_runner import FAKE_TOKEN_BASE, FakeModelRunner, reference_generate

from tokenfleet.config import SchedulerConfig
from tokenfleet.core.kv_cache import KVCacheManager
from tokenfleet.core.request import PLACEHOLDER, Request
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.scheduler_output import SchedulerOutput

pytestmark = pytest.mark.fake("runner")

BLOCK_SIZE = 4


def fill_placeholders(so: SchedulerOutput, sampled: dict[str, int]) -> None:
    """What the engine's runner does at launch (ModelRunner.fill_placeholders), on the
    rows themselves: each PLACEHOLDER input (a decode's one token) becomes the token its
    request sampled in the step before; 0 for one that got none (its row is dropped)."""
    for row in so.scheduled:
        if row.token_ids[-1] == PLACEHOLDER:
            row.token_ids[-1] = sampled.get(row.req_id, 0)


def _drive(
    scheduler: Scheduler,
    runner: FakeModelRunner,
    aborts: dict[int, list[str]],
    max_steps: int = 2000,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Steps in the overlap's order: plan n+1, then n's results (update) once n+1 took
    n's tokens, then the aborts of that turn. Returns each request's tokens and finish
    reason."""
    tokens: dict[str, list[int]] = {r: [] for r in scheduler.requests}
    reasons: dict[str, str] = {}
    in_flight: tuple[SchedulerOutput, dict[str, int]] | None = None
    for turn in range(max_steps):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            return tokens, reasons
        ahead = scheduler.schedule(float(turn))
        known = (r.all_token_ids[: r.num_known_tokens] for r in ahead.requests)
        assert all(PLACEHOLDER not in tokens_known for tokens_known in known)
        outputs = []
        if in_flight is not None:  # n's tokens: into n+1's placeholders, then n's update
            so, sampled = in_flight
            fill_placeholders(ahead, sampled)
            outputs = scheduler.update(so, ModelRunnerOutput(sampled))
        # The fake "forward" of n+1 (what it reads was written by n and before).
        in_flight = (ahead, runner.execute(ahead).sampled_token_ids) if ahead.scheduled else None
        for out in outputs:
            assert out.req_id not in reasons, f"{out.req_id}: an output after its end"
            tokens[out.req_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.req_id] = out.finish_reason
        for out in scheduler.abort_requests(aborts.get(turn, [])):
            reasons[out.req_id] = "abort"
    raise AssertionError(f"not finished after {max_steps} steps")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    num_requests=st.integers(1, 10),
    num_blocks=st.integers(12, 40),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 8),
)
def test_fake_runner_planning_ahead_gives_the_reference_tokens(
    seed: int, num_requests: int, num_blocks: int, budget: int, max_num_seqs: int
) -> None:
    """Random prompts sharing prefixes (prefix hits), max_tokens, stop tokens drawn from
    the reference's own outputs, a KV cache small enough to preempt, and aborts at random
    turns: each request's tokens are the reference's (cut at its stop token, max_tokens, or
    wherever it was aborted), a length end has exactly max_tokens, every block comes back,
    and only a request that ends by a stop token or an abort costs a dropped row, one at
    most."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True)
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=num_blocks * 4
    )
    scheduler = Scheduler(config, kv, plan_ahead=True)
    runner = FakeModelRunner(BLOCK_SIZE)
    shared = [rng.randrange(1, 900) for _ in range(rng.randint(0, 9))]
    expected: dict[str, tuple[list[int], int, int | None]] = {}
    for i in range(num_requests):
        prompt = shared + [rng.randrange(1, 900) for _ in range(rng.randint(1, 10))]
        max_tokens = rng.randint(1, 12)
        reference = reference_generate(prompt, max_tokens)
        stop = rng.choice(reference) if rng.random() < 0.4 else None
        params = SamplingParams(
            max_tokens=max_tokens, stop_token_ids=[] if stop is None else [stop]
        )
        request = Request(f"r{i}", prompt, params, arrival_time=float(i))
        scheduler.add_request(request)
        expected[request.req_id] = (reference, max_tokens, stop)
    aborts: dict[int, list[str]] = {}
    for req_id in expected:
        if rng.random() < 0.2:
            aborts.setdefault(rng.randint(0, 30), []).append(req_id)
    tokens, reasons = _drive(scheduler, runner, aborts)
    for req_id, (reference, max_tokens, stop) in expected.items():
        got = tokens[req_id]
        assert got == reference[: len(got)], req_id
        if reasons[req_id] == "length":
            assert len(got) == max_tokens
        elif reasons[req_id] == "stop":
            assert stop is not None and got[-1] == stop and stop not in got[:-1]
        else:
            assert reasons[req_id] == "abort"
    assert kv.pool.num_free_blocks == num_blocks and scheduler.requests == {}
    # A length end is known ahead: only stop tokens and aborts cost a row, one at most.
    assert scheduler.num_rows_dropped <= sum(r != "length" for r in reasons.values())
    assert all(t >= FAKE_TOKEN_BASE for out in runner.sampled for t in out.values())
