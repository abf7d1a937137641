"""Admission control: the TTFT predictor on hand-set step-time coefficients, the refusal
boundary and Retry-After, the in-flight bookkeeping, the EMA fallback, and the gateway's
GenerationService wired to it (batch never refused for load)."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.policy import admission
from tokenfleet.policy.admission import (
    AdmissionControl,
    Decodes,
    InFlightRequests,
    Replay,
    StepLimit,
    predict_ttft,
)
from tokenfleet.policy.step_model import LinearStepCost, StepFeatures
from tokenfleet.server.errors import APIError
from tokenfleet.server.metrics import Metrics
from tokenfleet.server.service import GenerationService
from tokenfleet.server.settings import ServeConfig

# Powers of two, so that every sum below is exact in floating point.
A, B, C, D, E = 2.0**-7, 2.0**-12, 2.0**-10, 2.0**-16, 2.0**-20
COEF = {
    "intercept": A,
    "prefill_tokens": B,
    "decode_seqs": C,
    "kv_tokens_read": D,
    "prefill_attention": E,
}


def step_seconds(coefficients: dict[str, float], features: StepFeatures) -> float:
    return LinearStepCost.from_dict(coefficients).predict(features)


def _prefill(num_tokens: int, start: int) -> float:
    """One prefill chunk's cost, without the step's intercept."""
    context = start + num_tokens
    return num_tokens * B + context * D + num_tokens * context * E


# -- the predictor -----------------------------------------------------------------------


def test_one_prompt_on_an_idle_engine_is_one_prefill_step() -> None:
    assert predict_ttft(COEF, 512, 100) == A + 100 * B + 100 * D + 100 * 100 * E
    # Exactly the budget: still one step.
    assert predict_ttft(COEF, 512, 512) == A + _prefill(512, 0)


def test_a_long_prompt_is_split_into_chunks_of_the_token_budget() -> None:
    # 1200 tokens at 512 a step: 512 from 0, 512 from 512, 176 from 1024; each chunk
    # attends to everything before it.
    expected = (A + _prefill(512, 0)) + (A + _prefill(512, 512)) + (A + _prefill(176, 1024))
    assert predict_ttft(COEF, 512, 1200) == expected


def test_prompts_ahead_are_prefilled_first_and_then_ride_along_as_decodes() -> None:
    # Step 1: the 300-token prompt whole, then 212 of the 400-token one.
    step1 = A + _prefill(300, 0) + _prefill(212, 0)
    # Step 2: the 300 one decodes (context 301) and takes a token of the budget; the rest
    # of the 400 one (188 from 212), then the new prompt whole.
    step2 = A + (C + 301 * D) + _prefill(188, 212) + _prefill(100, 0)
    assert predict_ttft(COEF, 512, 100, [300, 400]) == step1 + step2


def test_a_long_prompt_ahead_is_cut_to_the_long_prefill_cap_while_others_wait() -> None:
    # As the scheduler does (long_prefill_token_threshold): the 8,000-token prompt takes
    # 128 tokens, the new one its 100, and what is left (284) goes back to the long one.
    capped = predict_ttft(COEF, 512, 100, [8000], long_prefill_cap=128)
    assert capped == A + _prefill(412, 0) + _prefill(100, 0)
    # Without the cap the new prompt waits for the whole long one (16 steps in all).
    assert predict_ttft(COEF, 512, 100, [8000]) > 15 * A + capped
    # A cap over what the step leaves changes nothing.
    assert predict_ttft(COEF, 512, 100, [300, 400], long_prefill_cap=512) == predict_ttft(
        COEF, 512, 100, [300, 400]
    )


def test_running_decodes_of_both_classes_take_budget_first_under_fcfs() -> None:
    """The engine schedules fcfs as one class: running batch decodes take their token
    before a waiting prompt, as interactive ones do."""
    interactive, batch = Decodes(3, 3000), Decodes(2, 1000)
    # Step 1: the 5 decodes leave 507 tokens for the 600-token prompt.
    step1 = A + (5 * C + 4000 * D) + _prefill(507, 0)
    # Step 2: each context grew by one; 93 tokens finish the prompt.
    step2 = A + (5 * C + 4005 * D) + _prefill(93, 507)
    assert predict_ttft(COEF, 512, 600, (), interactive, batch) == step1 + step2


# The start-up profile's coefficients of a run on this CPU (bench/gateway_overhead.py).
PROFILED = {
    "intercept": 0.0508,
    "prefill_tokens": 0.00239,
    "decode_seqs": 0.00338,
    "kv_tokens_read": 9.11e-06,
    "prefill_attention": 8.99e-07,
}


def test_a_replay_past_max_steps_goes_on_in_strides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of 1,000 tokens in chunks of 10 takes 100 steps: with `max_steps` 4 the
    replay plans 4 steps one by one and the rest in at most 4 strides of steps with the
    same plan, each step priced at its own contexts: exact, as the cost is linear in them.
    A whole-context prompt cut to the step limit beside 3 streams (~7,000 steps, chunks
    shrinking as its context grows) comes within 3% of the whole replay, below it."""
    plans = 0
    plan = Replay.step

    def counted(*args: Any) -> Any:
        nonlocal plans
        plans += 1
        return plan(*args)

    monkeypatch.setattr(Replay, "step", counted)
    estimate = predict_ttft(COEF, 10, 1000, max_steps=4)
    assert plans <= 8
    whole = sum(A + _prefill(10, 10 * i) for i in range(100))
    assert estimate == pytest.approx(whole, rel=1e-12)
    # A prompt ahead ends inside the strides: the step with its last chunk is its own.
    assert predict_ttft(COEF, 10, 10, [995], max_steps=4) == pytest.approx(
        predict_ttft(COEF, 10, 10, [995], max_steps=200), rel=1e-12
    )

    limit = StepLimit(0.119, 16, 0.1326)
    streams = Decodes(3, 3 * 600)
    plans = 0
    estimate = predict_ttft(PROFILED, 512, 8191, (), streams, limit=limit, profile=PROFILED)
    assert plans <= 2 * admission.MAX_REPLAY_STEPS + 2
    plans = 0
    whole = predict_ttft(
        PROFILED, 512, 8191, (), streams, limit=limit, profile=PROFILED, max_steps=10**6
    )
    assert plans > 5000
    assert 0.97 * whole < estimate < whole


def test_a_one_token_chunk_is_priced_as_the_decode_the_runner_makes_of_it() -> None:
    # 513 tokens at 512 a step: the last token is a one-token query, so a decode.
    expected = (A + _prefill(512, 0)) + (A + C + 513 * D)
    assert predict_ttft(COEF, 512, 513) == expected


def test_prompts_beside_interactive_decodes_are_cut_to_the_step_limit() -> None:
    decodes, limit = Decodes(3, 3000), StepLimit(2.0**-4, 16, 2.0**-3)
    # The decodes cost A + 3C + 3000D; the waiting prompt is priced from its last full
    # block (16, harvest.prefill_budget): 19 of its tokens fit beside them, 20 do not.
    assert A + 3 * C + 3000 * D + _prefill(19, 16) <= limit.seconds
    assert A + 3 * C + 3000 * D + _prefill(20, 16) > limit.seconds
    step1 = A + 3 * C + 3000 * D + _prefill(19, 0)
    # Running now, it is priced from where it is: its last 11 tokens fit.
    assert A + 3 * C + 3003 * D + _prefill(11, 19) <= limit.seconds
    step2 = A + 3 * C + 3003 * D + _prefill(11, 19)
    assert predict_ttft(COEF, 512, 30, (), decodes, limit=limit) == step1 + step2
    # Without the limit (fcfs) the prompt goes whole in one step.
    assert predict_ttft(COEF, 512, 30, (), decodes) == A + 3 * C + 3000 * D + _prefill(30, 0)


def test_streams_over_the_limit_get_the_floor_and_an_unreachable_target_no_cut() -> None:
    decodes = Decodes(3, 3000)
    decode_step = A + 3 * C + 3000 * D
    # One decode alone (A + C + D) breaks a target of 2^-8 s: this hardware cannot meet
    # it, the prompt goes whole, as the engine plans it (harvest.prefill_budget).
    assert A + C + D > 2.0**-8
    uncut = StepLimit(2.0**-9, 16, 2.0**-8)
    assert predict_ttft(COEF, 512, 40, (), decodes, limit=uncut) == decode_step + _prefill(40, 0)
    # Nor when the start-up profile says one decode meets it but not beside the floor's
    # 16 tokens of a new prompt (harvest.target_reachable): a cut would crawl.
    nearly = {**COEF, "intercept": 2.0**-10}
    profiled = StepFeatures.of_chunks(((1, 0), (16, 0)))
    assert step_seconds(nearly, StepFeatures.of_chunk(1, 0)) <= 2.0**-8
    assert step_seconds(nearly, profiled) > 2.0**-8
    given = predict_ttft(COEF, 512, 40, (), decodes, limit=uncut, profile=nearly)
    assert given == decode_step + _prefill(40, 0)
    # Unless the profile says one decode and the floor's chunk meet it (the engine asks its
    # profile): then the decodes alone break the target and the prompt may add the
    # margin's worth (2^-9 s) to each step, priced by COEF (harvest.with_floor): 4 tokens
    # while it waits (priced from its last full block, 32), then 7 and fewer as its
    # context grows, the last 3 the rest.
    profile = {**COEF, "intercept": 2.0**-10, "prefill_tokens": 2.0**-16}
    assert step_seconds(profile, profiled) <= 2.0**-8
    chunks = [4, 7, 6, 6, 5, 5, 4, 3]
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    priced_from = [32, *starts[1:]]
    for n, start in zip(chunks[:-1], priced_from, strict=False):
        assert _prefill(n, start) <= 2.0**-9 < _prefill(n + 1, start)
    pairs = enumerate(zip(chunks, starts, strict=True))
    steps = [decode_step + 3 * i * D + _prefill(n, s) for i, (n, s) in pairs]
    given = predict_ttft(COEF, 512, 40, (), decodes, limit=uncut, profile=profile)
    assert given == pytest.approx(sum(steps))
    # Streams over the limit but within the target: the floor, 16 tokens a step.
    floored = StepLimit(2.0**-6, 16, 2.0**-3)
    assert 2.0**-6 < decode_step < 2.0**-3
    steps = [
        decode_step + _prefill(16, 0),
        decode_step + 3 * D + _prefill(16, 16),
        decode_step + 6 * D + _prefill(8, 32),
    ]
    assert max(steps) <= floored.target_seconds
    assert predict_ttft(COEF, 512, 40, (), decodes, limit=floored) == sum(steps)
    # Streams over a target one decode meets: the margin's worth of time (2^-7 s) takes
    # the whole 3-token prompt in one step (it used to crawl at one token a step).
    over = StepLimit(2.0**-7, 16, 2.0**-6)
    assert A + C + D <= 2.0**-6 < decode_step
    assert _prefill(3, 0) <= 2.0**-7
    assert predict_ttft(COEF, 512, 3, (), decodes, limit=over) == decode_step + _prefill(3, 0)


def test_batch_in_flight_fills_each_step_up_to_the_limit() -> None:
    limit = StepLimit(0.5, 16, 1.0)
    assert predict_ttft(COEF, 512, 100, limit=limit) == A + _prefill(100, 0)  # no batch
    assert predict_ttft(COEF, 512, 100, limit=limit, batch_in_flight=True) == 0.5
    # Batch decodes no longer ride in the token budget: they are in the limit.
    assert predict_ttft(COEF, 512, 100, (), Decodes(), Decodes(2, 1000), limit) == 0.5
    # A step over the limit by itself (the middle chunk) keeps its own time.
    assert A + _prefill(512, 512) > 0.5 > A + _prefill(512, 0)
    expected = 0.5 + (A + _prefill(512, 512)) + 0.5
    assert predict_ttft(COEF, 512, 1200, limit=limit, batch_in_flight=True) == expected


def test_missing_terms_count_as_zero() -> None:
    assert predict_ttft({"intercept": 0.25}, 512, 1200) == 0.75


# -- the verdict ---------------------------------------------------------------------------

# One second a step plus one per 512 prefill tokens.
SLOW = {"intercept": 1.0, "prefill_tokens": 1 / 512}


def test_refused_just_over_the_target_admitted_exactly_at_it() -> None:
    control = AdmissionControl(ttft_target_s=2.0, initial_prefill_tokens_per_s=1000.0)
    at = control.check(512, SLOW, 512)
    assert (at.admitted, at.predicted_ttft_s, at.predictor) == (True, 2.0, "step_model")
    assert at.retry_after_s is None
    over = control.check(514, SLOW, 512)
    # Two steps: 1 + 1 (512 tokens) and 1 + 2/512: 1.004 s over. Rounded up, not to nearest.
    assert over.predicted_ttft_s == 3.0 + 2 / 512
    assert (over.admitted, over.retry_after_s) == (False, 2)


def test_the_replay_stops_once_over_the_target() -> None:
    """Behind a long prompt the replay would run hundreds of steps on the gateway's event
    loop; admission only needs to know the target is passed."""
    control = AdmissionControl(ttft_target_s=2.0, initial_prefill_tokens_per_s=1000.0)
    control.requests.add("long", 100_000, interactive=True, now=0.0)
    # Step 1 (2.0 s) gives the long prompt 512 tokens; step 2 passes the target.
    refused = control.check(10, SLOW, 512)
    assert (refused.admitted, refused.predicted_ttft_s, refused.retry_after_s) == (False, 4.0, 2)
    # The whole replay: 195 steps of 512 of the long prompt's tokens, then its last 160
    # and the new prompt's 10.
    assert predict_ttft(SLOW, 512, 10, [100_000]) == 195 * 2.0 + 1.0 + 170 / 512


def test_a_prompt_that_can_never_get_in_is_refused_for_one_target() -> None:
    """Every sequence slot decoding and nothing to preempt (fcfs, nothing finishes in the
    replay): the prediction is infinite, and Retry-After the target."""
    control = AdmissionControl(2.0, 1000.0, max_num_seqs=2)
    for req_id in ("a", "b"):
        control.requests.add(req_id, 100, interactive=True, now=0.0)
        control.requests.first_token(req_id, 0.5)
    refused = control.check(10, COEF, 512)
    assert (refused.predicted_ttft_s, refused.retry_after_s) == (math.inf, 2)
    # Under the priority policy a batch decode gives up its slot: the prompt gets in.
    control = AdmissionControl(2.0, 1000.0, StepLimit(2.0**-4, 16, 2.0**-3), max_num_seqs=2)
    control.requests.add("a", 100, interactive=True, now=0.0)
    control.requests.add("b", 100, interactive=False, now=0.0)
    for req_id in ("a", "b"):
        control.requests.first_token(req_id, 0.5)
    assert control.check(10, COEF, 512).admitted


def test_retry_after_is_at_least_one_second() -> None:
    control = AdmissionControl(ttft_target_s=1e-6, initial_prefill_tokens_per_s=1000.0)
    verdict = control.check(1, COEF, 512)
    assert (verdict.admitted, verdict.retry_after_s) == (False, 1)


def test_interactive_work_ahead_counts_and_batch_work_does_not() -> None:
    control = AdmissionControl(ttft_target_s=2.0, initial_prefill_tokens_per_s=1000.0)
    control.requests.add("batch-1", 5000, interactive=False, now=0.0)
    assert control.check(512, SLOW, 512).admitted
    control.requests.add("chat-1", 10, interactive=True, now=0.0)
    # 522 tokens ahead and new: two steps now.
    refused = control.check(512, SLOW, 512)
    assert (refused.predicted_ttft_s, refused.retry_after_s) == (2.0 + 522 / 512, 2)
    # Its first token: it is now a decode (no decode term here) taking one token a step.
    control.requests.first_token("chat-1", 0.1)
    assert control.check(511, SLOW, 512).predicted_ttft_s == 1.0 + 511 / 512


# -- bookkeeping ---------------------------------------------------------------------------


def test_a_request_leaves_the_queue_at_its_first_token_or_when_aborted() -> None:
    requests = InFlightRequests()
    requests.add("a", 100, interactive=True, now=10.0)
    requests.add("b", 200, interactive=True, now=10.5)
    requests.add("c", 300, interactive=True, now=11.0)
    requests.add("z", 900, interactive=False, now=11.0)
    assert requests.prompts_ahead() == [100, 200, 300]
    first = requests.first_token("b", 12.0)
    assert first is not None and (first.ttft_s, first.num_prompt_tokens) == (1.5, 200)
    assert requests.first_token("b", 13.0) is None  # only the first one counts
    assert requests.prompts_ahead() == [100, 300]
    assert requests.decodes(interactive=True) == Decodes(1, 201)
    requests.remove("a")  # aborted before its first token
    assert requests.prompts_ahead() == [300]
    requests.remove("b")  # finished
    assert requests.decodes(interactive=True) == Decodes(0, 0)
    requests.first_token("z", 14.0)
    assert requests.decodes(interactive=False) == Decodes(1, 901)
    assert requests.first_token("a", 14.0) is None
    requests.remove("a")  # twice: a no-op
    assert len(requests) == 2
    with pytest.raises(ValueError, match="already in flight"):
        requests.add("c", 1, interactive=True, now=15.0)


# -- the fallback ----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["add", "batch", "first", "remove"]), st.integers(1, 300)),
        max_size=40,
    ),
    num_prompt_tokens=st.integers(1, 600),
    limit=st.sampled_from([None, StepLimit(2.0**-4, 16, 2.0**-3)]),
    cap=st.sampled_from([0, 128]),
    max_num_seqs=st.sampled_from([None, 4]),
)
def test_the_running_totals_predict_as_the_full_replay(
    events: list[tuple[str, int]],
    num_prompt_tokens: int,
    limit: StepLimit | None,
    cap: int,
    max_num_seqs: int | None,
) -> None:
    """AdmissionControl keeps totals as requests come and go, and prices a burst that fits
    one step from them; whatever happened before, it predicts what predict_ttft does."""
    admission = AdmissionControl(2.0, 1000.0, limit, cap, max_num_seqs=max_num_seqs)
    requests = admission.requests
    ids: list[str] = []
    for i, (kind, n) in enumerate(events):
        if kind in ("add", "batch"):
            requests.add(f"r{i}", n, interactive=kind == "add", now=0.0)
            ids.append(f"r{i}")
        elif ids:
            req_id = ids[n % len(ids)]
            if kind == "first":
                requests.first_token(req_id, 1.0)
            else:
                requests.remove(req_id)
                ids.remove(req_id)
    ahead, interactive, batch, has_batch = requests.snapshot()
    args = (COEF, 512, num_prompt_tokens, ahead, interactive, batch, limit, has_batch, None, cap)
    expected = predict_ttft(*args, stop_over=2.0, max_num_seqs=max_num_seqs)
    assert admission.predict(num_prompt_tokens, COEF, 512) == (expected, "step_model")
    # Up to the target the prediction is the whole replay's; over it, a lower bound.
    whole = predict_ttft(*args, max_num_seqs=max_num_seqs)
    assert expected == whole if whole <= 2.0 else 2.0 < expected <= whole
    # The totals are the sums over what is in flight.
    assert requests.ahead_tokens == sum(ahead)
    assert requests.ahead_features == StepFeatures.of_chunks((n, 0) for n in ahead)


def test_before_coefficients_the_prefill_speed_ema_predicts() -> None:
    control = AdmissionControl(ttft_target_s=2.0, initial_prefill_tokens_per_s=1000.0)
    assert control.predict(500, {}, 512) == (0.5, "ema")
    # A profile-less engine sends zeros until its first fit: still the fallback.
    assert control.predict(500, dict.fromkeys(COEF, 0.0), 512) == (0.5, "ema")
    control.requests.add("a", 1000, interactive=True, now=0.0)
    control.requests.add("b", 9000, interactive=False, now=0.0)
    assert control.predict(500, {}, 512) == (1.5, "ema")
    refused = control.check(1500, {}, 512)
    assert (refused.predicted_ttft_s, refused.retry_after_s) == (2.5, 1)
    # 1000 tokens in 0.5 s is 2000 tokens/s: the average moves a fifth of the way.
    control.first_token("a", 0.5)
    assert control.prefill_tokens_per_s == 1200.0
    # Short prompts and batch requests teach it nothing.
    control.requests.add("short", 10, interactive=True, now=0.0)
    control.first_token("short", 1.0)
    control.first_token("b", 1.0)
    assert control.prefill_tokens_per_s == 1200.0


# -- the gateway's service -------------------------------------------------------------------


class _Engine:
    """The parts of AsyncEngineClient the service uses, with outputs fed by the test."""

    def __init__(self, stats: SchedulerStats | None) -> None:
        self.config = EngineConfig()  # max_num_batched_tokens 512
        self.stats = stats
        self.info = None
        self.outputs: dict[str, asyncio.Queue[EngineCoreOutput]] = {}

    def is_healthy(self) -> bool:
        return True

    def predict_ttft(self, num_prompt_tokens: int) -> None:
        return None  # one engine: the service's own admission judges

    async def submit(self, request: EngineCoreRequest, on_the_way: int | None = None) -> _Outputs:
        queue = self.outputs[request.req_id] = asyncio.Queue()
        return _Outputs(queue)


class _Outputs:
    """A RequestOutputs (engine_client.py) over a queue the test feeds."""

    def __init__(self, queue: asyncio.Queue[EngineCoreOutput]) -> None:
        self.queue = queue
        self.arrived = 0.0
        self.finished = False

    def __aiter__(self) -> _Outputs:
        return self

    async def __anext__(self) -> EngineCoreOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        self.arrived, self.finished = time.monotonic(), out.finished
        return out

    async def aclose(self) -> None:
        self.finished = True


def _stats(coefficients: dict[str, float]) -> SchedulerStats:
    return SchedulerStats(0, 0, 0, 100, 0, 0, 0, 0, step_time_coefficients=coefficients)


@pytest.fixture(scope="module")
def tokenizer(model_folder: Path) -> Tokenizer:
    return Tokenizer(model_folder)


def _service(engine: _Engine, tokenizer: Tokenizer, ttft_target_s: float) -> GenerationService:
    config = ServeConfig(ttft_target_s=ttft_target_s)
    return GenerationService(engine, tokenizer, config, Metrics(lambda: engine.stats))  # type: ignore[arg-type]


def test_service_predicts_with_the_engine_step_limit(tokenizer: Tokenizer) -> None:
    engine = _Engine(None)
    engine.config = EngineConfig(tpot_target_s=0.25, harvest_margin=0.5, min_prefill_chunk=8)
    assert _service(engine, tokenizer, 2.0).admission.limit == StepLimit(0.125, 8, 0.25)
    engine.config = EngineConfig(scheduling_policy="fcfs")
    assert _service(engine, tokenizer, 2.0).admission.limit is None


def test_service_refuses_interactive_over_target_with_529_and_never_batch(
    tokenizer: Tokenizer,
) -> None:
    service = _service(_Engine(_stats(SLOW)), tokenizer, ttft_target_s=2.0)
    service.admit(512)
    with pytest.raises(APIError) as error:
        service.admit(514)
    assert (error.value.status, error.value.retry_after_s) == (529, 2)
    assert "overloaded" in error.value.message
    service.admit(10**6, priority="batch")


def test_service_falls_back_to_the_ema_until_the_engine_sends_coefficients(
    tokenizer: Tokenizer,
) -> None:
    engine = _Engine(None)
    service = _service(engine, tokenizer, ttft_target_s=2.0)
    service.admit(2000)  # 2 s at the assumed 1000 tokens/s
    with pytest.raises(APIError):
        service.admit(2001)
    engine.stats = _stats(SLOW)
    with pytest.raises(APIError) as error:
        service.admit(2000)  # 4 steps of the engine's model (7.9 s), replayed to the 2nd
    assert error.value.retry_after_s == 2
    assert "the predicted time to first token (at least 4.00 s)" in error.value.message


def test_service_keeps_its_requests_in_flight_until_first_token_and_end(
    tokenizer: Tokenizer,
) -> None:
    engine = _Engine(_stats(SLOW))
    service = _service(engine, tokenizer, ttft_target_s=2.0)
    requests = service.admission.requests

    async def scenario() -> None:
        params = SamplingParams(max_tokens=4)
        chat = service.generate([1] * 300, params, route="/v1/messages")
        batch = service.generate([1] * 700, params, route="/v1/messages", priority="batch")
        aborted = service.generate([1] * 50, params, route="/v1/messages")
        tasks = [asyncio.ensure_future(anext(g)) for g in (chat, batch, aborted)]
        await asyncio.sleep(0)
        assert requests.prompts_ahead() == [300, 50]  # batch work is not ahead of anyone
        chat_id, batch_id, _ = engine.outputs
        engine.outputs[chat_id].put_nowait(EngineCoreOutput(chat_id, [42]))
        engine.outputs[batch_id].put_nowait(EngineCoreOutput(batch_id, [42]))
        await asyncio.gather(tasks[0], tasks[1])
        # The autoscaler's batch rate counts batch tokens as they arrive, not at the end.
        assert service.window.batch_tokens_generated == 1
        assert requests.prompts_ahead() == [50]
        assert requests.decodes(interactive=True) == Decodes(1, 301)
        assert requests.decodes(interactive=False) == Decodes(1, 701)
        tasks[2].cancel()  # the client went away before its first token
        await asyncio.gather(tasks[2], return_exceptions=True)
        await aborted.aclose()
        assert requests.prompts_ahead() == []
        engine.outputs[chat_id].put_nowait(EngineCoreOutput(chat_id, [43], finish_reason="stop"))
        assert (await anext(chat)).finish_reason == "stop"
        engine.outputs[batch_id].put_nowait(EngineCoreOutput(batch_id, [44, 45]))
        await anext(batch)
        assert service.window.take()[1:] == (0, 0, 0, 3)  # one chat ended, met; 3 batch made
        await chat.aclose()
        await batch.aclose()
        assert len(requests) == 0

    asyncio.run(scenario())
    # The chat request was predicted (one step: 1 + 300/512 s) and measured: one sample.
    text = generate_latest(service.metrics.registry).decode()
    assert 'tokenfleet_ttft_prediction_error_ratio_count{predictor="step_model"} 1.0' in text
