"""The harvest budget: exact budgets on a hand-set step-time model, the scheduler asking
for it once the interactive part is planned, and an engine whose steps beside
interactive streams are never predicted over the TPOT target (less the margin)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

import tokenfleet.engine.core
from tokenfleet.config import EngineConfig, SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreRequest, SchedulerStats
from tokenfleet.core.kv_cache import KVCacheManager
from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE, Request
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.engine.core import EngineCore
from tokenfleet.policy.harvest import (
    REACHABLE_TOLERANCE,
    _most_tokens,
    batch_chunks,
    harvest_budget,
    pack,
    prefill_budget,
    step_time_limit,
)
from tokenfleet.policy.step_model import (
    TERMS,
    LinearStepCost,
    StepFeatures,
    StepModelConfig,
    StepTimeModel,
    step_features,
)
from tokenfleet.server.metrics import Metrics

# Coefficients in ticks of 2^-26 s, so that every prediction below is exact in floats:
# 7.8 ms a step, 61 us a prefill token, 0.98 ms a decode, 0.95 us a KV token read, 15 ns
# a query token x context.
TICK = 2.0**-26
A, B, C, D, E = 2**19, 2**12, 2**16, 2**6, 1
# 62.5 ms less a quarter: 46.875 ms, 3 * 2^20 ticks.
TARGET, MARGIN = 2.0**-4, 0.25
LIMIT = 3 * 2**20


class HandSetStepModel(StepTimeModel):
    """A step-time model with known coefficients that never refits from measured steps
    (the fixed runner's are microseconds)."""

    def __init__(self, *ticks: int) -> None:
        super().__init__(StepModelConfig(profile=False))
        self.coef = np.array(ticks, dtype=float) * TICK

    @property
    def coefficients(self) -> dict[str, float]:
        return {t: float(c) for t, c in zip(TERMS, self.coef, strict=True)}

    def predict(self, features: StepFeatures) -> float:
        return float(features.vector() @ self.coef)

    def observe(self, features: StepFeatures, seconds: float) -> None:
        pass


MODEL = HandSetStepModel(A, B, C, D, E)


def budget(
    interactive: StepFeatures,
    batch: list[tuple[int, int]],
    max_tokens: int = 512,
    batch_step_limit_s: float | None = None,
) -> int:
    return harvest_budget(
        MODEL,
        interactive,
        batch,
        tpot_target_s=TARGET,
        margin=MARGIN,
        max_tokens=max_tokens,
        batch_step_limit_s=batch_step_limit_s,
    )


# -- the budget function ----------------------------------------------------------------


def test_limit_is_the_target_less_the_margin() -> None:
    assert step_time_limit(TARGET, MARGIN) == LIMIT * TICK == 0.046875


# 4 interactive decodes at context 100: 812,032 ticks, 2,333,696 to spare.
FOUR_DECODES = StepFeatures(decode_seqs=4, kv_tokens_read=400)


def test_no_interactive_work_gets_every_token_left() -> None:
    assert budget(StepFeatures(), [(0, 300)]) == 512
    assert budget(StepFeatures(), [(0, 10**6)], max_tokens=37) == 37


def test_a_batch_step_limit_bounds_steps_of_batch_alone() -> None:
    def alone(batch: list[tuple[int, int]], limit_ticks: int, max_tokens: int = 512) -> int:
        return budget(StepFeatures(), batch, max_tokens, batch_step_limit_s=limit_ticks * TICK)

    # A batch decode at context 200 costs 78,336 ticks: 33 fit beside the intercept
    # (2,585,088 of 2,621,440 ticks), not 34.
    assert alone([(199, 1)] * 40, LIMIT) == 33
    # A prompt from 0: n^2 + 4,160 n <= 2,621,440 gives 555 tokens, then the token cap.
    assert alone([(0, 10**6)], LIMIT, max_tokens=1000) == 555
    assert MODEL.predict(StepFeatures.of_chunk(555, 0)) <= LIMIT * TICK
    assert MODEL.predict(StepFeatures.of_chunk(556, 0)) > LIMIT * TICK
    assert alone([(0, 10**6)], LIMIT) == 512
    # Below the step's fixed cost: still one token, so that batch advances.
    assert alone([(0, 10**6)], A - 1) == 1
    # Beside interactive work the harvest limit rules, the batch step limit does not.
    assert (
        budget(FOUR_DECODES, [(199, 1)] * 40, batch_step_limit_s=A * TICK)
        == budget(FOUR_DECODES, [(199, 1)] * 40)
        == 29
    )


def test_batch_decodes_are_packed_exactly() -> None:
    assert MODEL.predict(FOUR_DECODES) == (A + 4 * C + 400 * D) * TICK == 812_032 * TICK
    # A batch decode at context 200 costs C + 200 D = 78,336 ticks: 29 fit (2,271,744).
    assert budget(FOUR_DECODES, [(199, 1)] * 40) == 29
    assert budget(FOUR_DECODES, [(199, 1)] * 40, max_tokens=20) == 20


def _pack_one_by_one(
    model: LinearStepCost,
    step: StepFeatures,
    chunks: list[tuple[int, int]],
    limit: float,
    most: int,
) -> int:
    """pack's rule with every chunk priced alone, decodes too (the reference)."""
    total = 0
    for start, wanted in chunks:
        n = _most_tokens(model, step, start, min(wanted, most - total), limit)
        total += n
        if n < wanted or total >= most:
            break
        step += StepFeatures.of_chunk(n, start)
    return total


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_pack_prices_runs_of_decodes_in_one_go_as_one_by_one(seed: int) -> None:
    """Runs of decodes priced by one binary search (_decodes_fit) give what pricing every
    chunk alone gives, cut where it cuts: ten random steps a seed, mostly decodes, with
    coefficients in ticks (exact: limits met to the tick) and room for a few dozen. (A
    decode's context off by one token, or the limit made strict, fails within a run.)"""
    rng = random.Random(seed)
    for _ in range(10):
        ticks = (rng.randint(0, 10**5), rng.randint(0, 2000), rng.randint(0, 5000))
        model = LinearStepCost(tuple(t * TICK for t in (*ticks, rng.randint(1, 50), 1)))
        chunks = [
            (rng.randint(0, 500), rng.choice([1, 1, 1, 1, 1, 1, 2, 17, 300]))
            for _ in range(rng.randint(0, 40))
        ]
        step = StepFeatures(decode_seqs=3, kv_tokens_read=900)
        limit = model.predict(step) + rng.randint(0, 1_500_000) * TICK
        most = rng.randint(0, 600)
        expected = _pack_one_by_one(model, step, chunks, limit, most)
        assert pack(model, step, chunks, limit, most) == expected, (ticks, chunks, limit, most)


def test_a_run_of_decodes_takes_exactly_those_within_the_limit_met_to_the_tick() -> None:
    three = FOUR_DECODES + StepFeatures(decode_seqs=3, kv_tokens_read=3 * 200)
    at_three = MODEL.predict(three)
    assert pack(MODEL, FOUR_DECODES, [(199, 1)] * 5, at_three, 100) == 3
    assert pack(MODEL, FOUR_DECODES, [(199, 1)] * 5, at_three - TICK, 100) == 2
    assert pack(MODEL, FOUR_DECODES, [(199, 1)] * 5 + [(0, 9)], at_three * 10, 100) == 14


def test_a_prompt_chunk_is_priced_at_its_own_context_once() -> None:
    # n tokens from 1,000: n B + (1000 + n) D + n (1000 + n) E; the most within the
    # 2,333,696 ticks left: 407. The context is read once per chunk, not once a token.
    assert budget(FOUR_DECODES, [(1000, 1000)]) == 407
    step = FOUR_DECODES + StepFeatures.of_chunk(407, 1000)
    assert MODEL.predict(step) <= LIMIT * TICK
    assert MODEL.predict(FOUR_DECODES + StepFeatures.of_chunk(408, 1000)) > LIMIT * TICK
    # A chunk that takes all it has to go leaves the rest to the next: 10 + 400; one cut
    # short ends the packing (the scheduler gives the next one nothing either).
    assert budget(FOUR_DECODES, [(0, 10), (1000, 1000)]) == 10 + 400
    assert budget(FOUR_DECODES, [(1000, 1000), (0, 10)]) == 407
    assert pack(MODEL, FOUR_DECODES, [(0, 10), (1000, 1000)], LIMIT * TICK, 100) == 100


def test_heavy_interactive_load_leaves_batch_nothing() -> None:
    # 48 decodes: the per-decode cost alone is the whole limit.
    heavy = StepFeatures(decode_seqs=48, kv_tokens_read=48_000)
    assert MODEL.predict(heavy) > LIMIT * TICK
    assert budget(heavy, [(199, 1)]) == 0
    # Exactly at the limit: no time left for a token.
    at_limit = StepFeatures(decode_seqs=40)  # 2^19 + 40 * 2^16 = 3 * 2^20
    assert MODEL.predict(at_limit) == LIMIT * TICK
    assert budget(at_limit, [(0, 1)]) == 0
    # C + D spare: one decode of context 1 fits exactly, not one of context 2.
    spare_one = StepFeatures(decode_seqs=38, kv_tokens_read=1023)
    assert MODEL.predict(spare_one) == (LIMIT - C - D) * TICK
    assert budget(spare_one, [(0, 1), (0, 1)]) == 1
    assert budget(spare_one, [(1, 1)]) == 0


def test_batch_chunks_follow_the_scheduler_order() -> None:
    def request(req_id: str, num_tokens: int, priority: int = PRIORITY_BATCH) -> Request:
        return Request(
            req_id, [1] * num_tokens, SamplingParams(), arrival_time=0.0, priority=priority
        )

    running = [request("i", 10, PRIORITY_INTERACTIVE), request("b", 20), request("c", 50)]
    running[1].num_computed_tokens = 19
    running[2].num_computed_tokens = 16
    waiting = [request("wi", 500, PRIORITY_INTERACTIVE)]
    waiting += [request("w0", 30), request("w1", 17), request("w2", 33), request("w3", 40)]
    # Running batch from where they are; then the head of the batch queue, each from
    # after its last full block before the last token, yet up to its whole prompt.
    assert list(batch_chunks(running, waiting, 3, 16)) == [
        (19, 1),
        (16, 34),
        (16, 30),
        (16, 17),
        (32, 33),
    ]


# -- the scheduler asks for it -----------------------------------------------------------


def _scheduler(max_num_batched_tokens: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8)
    return Scheduler(config, KVCacheManager(64, 16, enable_caching=True))


def _add(scheduler: Scheduler, req_id: str, prompt: list[int], priority: int) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    scheduler.add_request(Request(req_id, prompt, params, arrival_time=0.0, priority=priority))


def _asking(answers: list[int]) -> tuple[list[list[tuple[int, int]]], Callable[..., int]]:
    asked: list[list[tuple[int, int]]] = []

    def ask(chunks: list[tuple[int, int]]) -> int:
        asked.append(chunks)
        return answers[len(asked) - 1]

    return asked, ask


def _planned(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.req_id, s.num_tokens, s.start_pos) for s in out.scheduled]


def test_scheduler_asks_once_the_interactive_part_is_planned() -> None:
    scheduler = _scheduler()
    _add(scheduler, "i", list(range(10)), PRIORITY_INTERACTIVE)
    _add(scheduler, "b", list(range(100, 130)), PRIORITY_BATCH)
    asked, ask = _asking([5, 0, 64])
    out = scheduler.schedule(0.0, batch_token_budget=ask)
    assert _planned(out) == [("i", 10, 0), ("b", 5, 0)]
    assert asked == [[(10, 0)]]
    scheduler.update(out, ModelRunnerOutput({"i": 7}))  # b, mid-prompt, samples nothing
    assert _planned(scheduler.schedule(1.0, batch_token_budget=ask)) == [("i", 1, 10)]
    assert asked[1] == [(1, 10)]
    scheduler.abort_requests(["i"])
    # No interactive work: asked with nothing planned.
    assert _planned(scheduler.schedule(2.0, batch_token_budget=ask)) == [("b", 25, 5)]
    assert asked[2] == []


def test_scheduler_does_not_ask_without_batch_work() -> None:
    scheduler = _scheduler()
    _add(scheduler, "i", list(range(10)), PRIORITY_INTERACTIVE)
    asked, ask = _asking([])
    assert _planned(scheduler.schedule(0.0, batch_token_budget=ask)) == [("i", 10, 0)]
    assert asked == []


def test_scheduler_refuses_a_negative_answer() -> None:
    scheduler = _scheduler()
    _add(scheduler, "b", list(range(10)), PRIORITY_BATCH)
    with pytest.raises(ValueError, match="batch_token_budget must be at least 0, got -1"):
        scheduler.schedule(0.0, batch_token_budget=lambda chunks: -1)


# -- interactive prompts beside interactive streams --------------------------------------


def _req(req_id: str, num_tokens: int, num_computed: int = 0, priority: int = 0) -> Request:
    request = Request(
        req_id, [1] * num_tokens, SamplingParams(), arrival_time=0.0, priority=priority
    )
    request.num_computed_tokens = num_computed
    return request


def _prefill_budget(running: list[Request], waiting: Any = (), min_tokens: int = 16) -> int | None:
    return prefill_budget(
        MODEL,
        running,
        waiting,
        max_num_seqs=8,
        block_size=16,
        tpot_target_s=TARGET,
        margin=MARGIN,
        max_tokens=512,
        min_tokens=min_tokens,
    )


def test_prompts_are_capped_only_while_streams_decode_beside_them() -> None:
    decoding, prompt = _req("d", 41, 40), _req("p", 5000, 4000)
    batch_prompt = _req("b", 3000, priority=PRIORITY_BATCH)
    assert _prefill_budget([prompt, batch_prompt]) is None  # no stream to protect
    assert _prefill_budget([decoding, _req("b2", 51, 50, PRIORITY_BATCH)]) is None  # no prompt
    # Decode at context 41: A + C + 41 D = 592,448 ticks; n prompt tokens from 4,000:
    # n B + (4000 + n) D + n (4000 + n) E. The most within 3,145,728 ticks: 272.
    assert _prefill_budget([prompt, decoding, batch_prompt]) == 272
    step = StepFeatures.of_chunk(1, 40) + StepFeatures.of_chunk(272, 4000)
    assert MODEL.predict(step) <= LIMIT * TICK
    assert MODEL.predict(step + StepFeatures(prefill_tokens=1, kv_tokens_read=1)) > LIMIT * TICK
    # A prompt that takes all it has to go leaves the rest to the next one: 20 + 262.
    short = _req("s", 20)
    assert _prefill_budget([decoding, short, prompt]) == 20 + 262
    assert _prefill_budget([decoding, prompt, short]) == 272  # cut: the next gets nothing

    # A waiting prompt is priced from its last full block (992) but may take all of its
    # 1,000 tokens; batch requests behind it are never read.
    def waiting() -> Any:
        yield _req("w", 1000)
        yield _req("wb", 5000, priority=PRIORITY_BATCH)
        raise AssertionError("read past the interactive requests")

    assert _prefill_budget([decoding], waiting()) == 444
    # Within the step's token budget (512, less the decode).
    assert _prefill_budget([decoding, _req("p0", 1000)]) == 511
    # Fewer tokens than the floor (16) fit within the limit: what fits, not the floor.
    # The margin is kept for the model's errors while the decodes alone are within the
    # limit: from 35,000 (n B + (35,000 + n) D + n (35,000 + n) E beside the decode), 7
    # tokens keep the step within LIMIT and 8 do not, though 16 would keep it within TARGET.
    mid_late = _req("mid_late", 36_000, 35_000)
    assert _prefill_budget([decoding, mid_late]) == 7
    assert _prefill_budget([decoding, mid_late], min_tokens=3) == 7  # more than the floor
    beside = StepFeatures.of_chunk(1, 40)
    seven, eight, sixteen = (beside + StepFeatures.of_chunk(n, 35_000) for n in (7, 8, 16))
    assert MODEL.predict(seven) <= LIMIT * TICK < MODEL.predict(eight)
    assert MODEL.predict(sixteen) <= TARGET
    # Not even one prompt token fits beside the decodes: one a step, so it still advances.
    late = _req("late", 40_000, 39_000)
    assert _prefill_budget([decoding, late]) == 1
    assert _prefill_budget([decoding, late], min_tokens=3) == 1
    deepest = _req("deepest", 70_000, 60_000)
    assert _prefill_budget([decoding, deepest]) == 1
    # Streams that alone break the limit but not the target: the floor.
    many = [_req(f"d{n}", 41, 40) for n in range(40)]
    streams = StepFeatures(decode_seqs=40, kv_tokens_read=40 * 41)
    assert LIMIT * TICK < MODEL.predict(streams) <= TARGET
    assert MODEL.predict(streams + StepFeatures.of_chunk(16, 4000)) <= TARGET
    assert _prefill_budget([*many, prompt]) == 16
    # Streams that alone break the target: the floor may add the margin's worth of time
    # (TARGET - LIMIT = 2^20 ticks) to their step, not the whole prompt. From 4,000, 96
    # tokens cost exactly that (256,000 + 8,160 n + n^2 ticks), so the floor's 16 go; from
    # 15,000, 4 do (960,000 + 19,160 n + n^2); from 60,000 not one, and it gets one.
    more = [_req(f"d{n}", 41, 40) for n in range(60)]
    alone = StepFeatures(decode_seqs=60, kv_tokens_read=60 * 41)
    assert MODEL.predict(alone) > TARGET
    assert _prefill_budget([*more, prompt]) == 16
    mid = _req("mid", 16_000, 15_000)
    assert _prefill_budget([*more, mid]) == 4
    headroom = TARGET - LIMIT * TICK
    four, five = (alone + StepFeatures.of_chunk(n, 15_000) for n in (4, 5))
    assert MODEL.predict(four) <= MODEL.predict(alone) + headroom < MODEL.predict(five)
    assert _prefill_budget([*more, deepest]) == 1
    # A target one decode alone breaks (this hardware cannot meet it): no cut at all.
    assert MODEL.predict(StepFeatures.of_chunk(1, 0)) > 2.0**-7
    unreachable = prefill_budget(
        MODEL,
        [decoding, prompt],
        (),
        max_num_seqs=8,
        block_size=16,
        tpot_target_s=2.0**-7,
        margin=MARGIN,
        max_tokens=512,
        min_tokens=16,
    )
    assert unreachable is None
    # Nor one that a decode meets but not beside the floor's 16 tokens of a new prompt:
    # cut to what is left, a burst of short prompts would crawl a few tokens a step; but a
    # floor's step over the target by less than the profile's tolerance still counts as
    # reachable (harvest.REACHABLE_TOLERANCE): a noisy start-up profile must not flip it.
    dear = HandSetStepModel(A, 2**15, C, D, E)  # prompt tokens dear next to a decode
    one = dear.predict(StepFeatures.of_chunk(1, 0))
    beside_floor = dear.predict(StepFeatures.of_chunks(((1, 0), (16, 0))))
    nearly_full = (one + beside_floor / REACHABLE_TOLERANCE) / 2
    assert one <= nearly_full < beside_floor / REACHABLE_TOLERANCE
    within = beside_floor / (1 + (REACHABLE_TOLERANCE - 1) / 2)
    assert nearly_full < within < beside_floor

    def short_prompt_budget(target: float) -> int | None:
        return prefill_budget(
            dear,
            [decoding, _req("short", 16)],
            (),
            max_num_seqs=8,
            block_size=16,
            tpot_target_s=target,
            margin=0.0,
            max_tokens=512,
            min_tokens=16,
        )

    assert short_prompt_budget(nearly_full) is None
    cut = short_prompt_budget(within)
    assert cut is not None and 1 <= cut < 16
    assert dear.predict(StepFeatures.of_chunks(((1, 40), (cut, 0)))) <= within


def test_scheduler_caps_prompt_chunks_not_decodes() -> None:
    scheduler = _scheduler(max_num_batched_tokens=64)
    _add(scheduler, "p", list(range(40)), PRIORITY_INTERACTIVE)
    _add(scheduler, "d", list(range(100, 110)), PRIORITY_INTERACTIVE)
    out = scheduler.schedule(0.0, prefill_token_budget=16)
    assert _planned(out) == [("p", 16, 0)]  # one prompt's worth; d waits its turn
    scheduler.update(out, ModelRunnerOutput({}))
    out = scheduler.schedule(1.0)
    assert _planned(out) == [("p", 24, 16), ("d", 10, 0)]
    scheduler.update(out, ModelRunnerOutput({"p": 5, "d": 6}))
    _add(scheduler, "q", list(range(200, 230)), PRIORITY_INTERACTIVE)
    _add(scheduler, "b", list(range(300, 330)), PRIORITY_BATCH)
    # p and d decode; q's prompt is cut to the budget; batch is not held to it.
    out = scheduler.schedule(2.0, prefill_token_budget=7)
    assert _planned(out) == [("p", 1, 40), ("d", 1, 10), ("q", 7, 0), ("b", 30, 0)]
    scheduler.update(out, ModelRunnerOutput({"p": 5, "d": 6, "b": 9}))
    # A prompt already running, ahead of a decode, is cut and the decode still runs.
    out = scheduler.schedule(3.0, prefill_token_budget=0)
    assert _planned(out) == [("p", 1, 41), ("d", 1, 11), ("b", 1, 30)]
    with pytest.raises(ValueError, match="prefill_token_budget must be at least 0, got -1"):
        scheduler.schedule(4.0, prefill_token_budget=-1)


# -- the engine --------------------------------------------------------------------------
# On the fixed runner (marker `fake`, names test_fixed_runner_...): the real engine and
# scheduler, a runner that answers a fixed token without the model, and the hand-set MODEL
# in place of the start-up profile's fit, so that every plan is known exactly.


def _request(req_id: str, prompt: list[int], max_tokens: int, priority: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt, params, arrival_time=0.0, priority=priority)


def _engine_config(
    model_folder: Path, max_num_batched_tokens: int, **settings: Any
) -> EngineConfig:
    """The fixed runner at TARGET and MARGIN, 16 sequences a step; steps one after
    another (no overlap: each test reads the plan of the step it just ran, and the
    overlap's exactness is tests/engine/test_overlap.py's)."""
    return EngineConfig(
        model=str(model_folder),
        runner="fixed",
        overlap=False,
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16),
        tpot_target_s=TARGET,
        harvest_margin=MARGIN,
        **settings,
    )


def _recording_engine(
    config: EngineConfig, before_step: Callable[[Scheduler], None] | None = None
) -> tuple[EngineCore, list[SchedulerOutput]]:
    """An engine on MODEL whose every planned step is recorded, in order; `before_step`
    sees the scheduler just before each step is planned."""
    engine = EngineCore(config)
    engine.step_model = MODEL
    outs: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording(now: float, **kwargs: Any) -> SchedulerOutput:
        if before_step is not None:
            before_step(engine.scheduler)
        outs.append(schedule(now, **kwargs))
        return outs[-1]

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return engine, outs


@pytest.mark.fake("runner")
def test_fixed_runner_engine_packs_batch_within_the_tpot_target(model_folder: Path) -> None:
    batch_left: list[int] = []  # batch tokens still to compute before each step

    def count_batch_left(scheduler: Scheduler) -> None:
        batch = [r for r in scheduler.requests.values() if not r.is_interactive]
        batch_left.append(sum(r.num_tokens - r.num_computed_tokens for r in batch))

    engine, outs = _recording_engine(_engine_config(model_folder, 256), count_batch_left)
    scheduler = engine.scheduler
    max_tokens = {f"b{n}": 8 for n in range(6)} | {f"i{n}": 12 for n in range(3)}
    for n in range(6):
        engine.add_request(_request(f"b{n}", [100 + n] * 300, 8, PRIORITY_BATCH))
    tokens: dict[str, list[int]] = {r: [] for r in max_tokens}
    finish: dict[str, str | None] = {}
    trace: list[tuple[int, int, int | None]] = []  # interactive tokens, batch, budget
    while engine.has_unfinished_requests():
        if len(outs) == 2:  # interactive streams arrive mid-batch
            for n in range(3):
                engine.add_request(_request(f"i{n}", [200 + n] * 40, 12, PRIORITY_INTERACTIVE))
            stats = engine.stats()
            assert stats.num_waiting_by_class == {"interactive": 3, "batch": 4}
            assert stats.num_running_by_class == {"interactive": 0, "batch": 2}
        result = engine.step(0.05 * len(outs))
        for output in result.outputs:
            tokens[output.req_id] += output.new_token_ids
            finish[output.req_id] = output.finish_reason
        out = outs[-1]
        chunks = {"i": StepFeatures(), "b": StepFeatures()}
        num_tokens = {"i": 0, "b": 0}
        for s in out.scheduled:
            chunks[s.req_id[0]] += StepFeatures.of_chunk(s.num_tokens, s.start_pos)
            num_tokens[s.req_id[0]] += s.num_tokens
        assert engine.last_prediction == MODEL.predict(chunks["i"] + chunks["b"])
        if chunks["i"] == StepFeatures():  # no interactive stream: the whole step
            assert engine.last_batch_token_budget == 256
            assert num_tokens["b"] == min(256, batch_left[-1])
        elif MODEL.predict(chunks["i"]) <= LIMIT * TICK:
            assert engine.last_prediction <= LIMIT * TICK
        else:
            assert num_tokens["b"] == 0
        trace.append((num_tokens["i"], num_tokens["b"], engine.last_batch_token_budget))
    # Two full batch steps; the interactive prompts beside 136 batch prompt tokens; then
    # the 11 interactive decodes beside the batch prompts, each chunk priced at its own
    # context (253 tokens a step while whole prompts remain), then beside batch decodes
    # that fit one fewer as their contexts grow; the last batch decode alone.
    assert trace == (
        [(0, 256, 256)] * 2
        + [(120, 136, 136)]
        + [(3, 253, 253)] * 4
        + [(3, n, n) for n in (157, 6, 5, 4, 4, 3, 2)]
        + [(0, 1, 256)]
    )
    fixed = engine.runner.token_id  # type: ignore[union-attr]
    assert tokens == {r: [fixed] * n for r, n in max_tokens.items()}
    assert finish == dict.fromkeys(max_tokens, "length")
    stats = engine.stats()
    assert stats.num_running_by_class == {"interactive": 0, "batch": 0}
    assert stats.num_waiting_by_class == {"interactive": 0, "batch": 0}
    assert stats.num_preemptions_by_class == {"interactive": 0, "batch": 0}
    assert stats.num_kv_blocks_reserved_interactive == scheduler.reserve_blocks == 15
    assert stats.batch_token_budget == 256


@pytest.mark.fake("runner")
def test_fixed_runner_engine_keeps_steps_of_batch_alone_within_the_batch_step_limit(
    model_folder: Path,
) -> None:
    config = _engine_config(model_folder, 512, batch_step_limit_s=LIMIT * TICK)
    engine, outs = _recording_engine(config)
    engine.add_request(_request("b0", [6] * 600, 2, PRIORITY_BATCH))
    engine.add_request(_request("b1", [7] * 600, 2, PRIORITY_BATCH))
    engine.step(0.0)
    # Waiting, b0 is priced from its dearest start (592, all full blocks cached): n^2 +
    # 4,752 n + 37,888 <= 2,621,440 ticks gives 492 tokens, and it takes them from 0.
    assert engine.last_batch_token_budget == 492
    assert [(s.req_id, s.num_tokens) for s in outs[0].scheduled] == [("b0", 492)]
    assert MODEL.predict(StepFeatures.of_chunk(492, 592)) <= LIMIT * TICK
    assert MODEL.predict(StepFeatures.of_chunk(493, 592)) > LIMIT * TICK


@pytest.mark.fake("runner")
def test_fixed_runner_engine_cuts_a_long_prompt_to_keep_streams_within_the_target(
    model_folder: Path,
) -> None:
    engine, outs = _recording_engine(_engine_config(model_folder, 512, min_prefill_chunk=16))
    for n in range(3):
        engine.add_request(_request(f"s{n}", [200 + n] * 40, 400, PRIORITY_INTERACTIVE))
    engine.step(0.0)
    engine.add_request(_request("long", [7] * 6000, 2, PRIORITY_INTERACTIVE))
    chunks: list[int] = []
    while "long" in engine.scheduler.requests:
        engine.step(0.05 * len(outs))
        planned = {s.req_id: s for s in outs[-1].scheduled}
        assert {"s0", "s1", "s2"} <= planned.keys()  # every stream gets its token
        chunk = planned["long"].num_tokens if "long" in planned else 0
        chunks.append(chunk)
        predicted = MODEL.predict(step_features(outs[-1]))
        assert predicted <= LIMIT * TICK  # the floor (16) is never needed here
    # The prompt in chunks that shrink as its context grows, then its one decode; the
    # first, while it waited, priced as if most of it were cached (the dearest start).
    assert sum(chunks) == 6000 + 1 and chunks[-1] == 1
    assert chunks[1:-1] == sorted(chunks[1:-1], reverse=True)
    assert 16 < chunks[0] < chunks[1] < 512


@pytest.mark.fake("runner")
def test_fixed_runner_engine_times_each_first_token_from_the_step_after_taking_the_request(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own TTFT (what the gateway's overhead is measured against): from the
    start of the first step after add_request to the end of the step with the first
    token, by class; a request aborted before its first token is not counted. The
    engine's clock is set by hand, and each step takes one second of it."""
    engine, _ = _recording_engine(_engine_config(model_folder, 64))
    now = [0.0]
    clock = SimpleNamespace(
        monotonic=lambda: now[0], perf_counter=time.perf_counter, time=time.time
    )
    monkeypatch.setattr(tokenfleet.engine.core, "time", clock)
    run = engine.runner.run

    def one_second(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        now[0] += 1.0
        return run(scheduler_output)

    monkeypatch.setattr(engine.runner, "run", one_second)
    engine.add_request(_request("i0", [5] * 8, 3, PRIORITY_INTERACTIVE))
    engine.add_request(_request("b0", [6] * 100, 3, PRIORITY_BATCH))
    engine.add_request(_request("b1", [7] * 100, 3, PRIORITY_BATCH))
    now[0] = 10.0  # taken a while ago: the wait before the engine's first step is not its own
    engine.step(0.0)  # 10 -> 11: i0's first token; b0 not yet through its prompt
    assert engine.stats().ttft_count_by_class == {"interactive": 1, "batch": 0}
    engine.add_request(_request("i1", [8] * 8, 3, PRIORITY_INTERACTIVE))
    engine.abort(["b1"])
    now[0] = 20.0
    engine.step(0.0)  # 20 -> 21: i1's first token and b0's
    stats = engine.stats()
    assert stats.ttft_count_by_class == {"interactive": 2, "batch": 1}
    assert stats.ttft_sum_s_by_class == {"interactive": 1.0 + 1.0, "batch": 21 - 10}
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        engine.step(0.0)  # later tokens are not first tokens
    assert engine.stats().ttft_count_by_class == {"interactive": 2, "batch": 1}
    assert engine.stats().ttft_sum_s_by_class == {"interactive": 2.0, "batch": 11.0}


def test_config_and_stats_defaults() -> None:
    config = EngineConfig()
    assert (config.tpot_target_s, config.harvest_margin) == (0.06, 0.1)
    with pytest.raises(ValueError, match="tpot_target_s must be positive, got 0"):
        EngineConfig(tpot_target_s=0)
    with pytest.raises(ValueError, match=r"harvest_margin must be in \[0, 1\), got 1"):
        EngineConfig(harvest_margin=1)
    assert EngineConfig().batch_step_limit_s is None
    with pytest.raises(ValueError, match="batch_step_limit_s must be positive, got 0"):
        EngineConfig(batch_step_limit_s=0)
    stats = SchedulerStats(0, 0, 0, 10, 0, 0, 0, 0)
    assert stats.batch_token_budget is None
    assert stats.num_preemptions_by_class == {}


def test_metrics_export_classes_reserve_and_budget() -> None:
    stats = SchedulerStats(
        num_running=5,
        num_waiting=7,
        num_kv_blocks_used=0,
        num_kv_blocks_total=10,
        num_prefix_query_tokens=0,
        num_prefix_hit_tokens=0,
        num_preemptions=4,
        num_steps=0,
        num_running_by_class={"interactive": 2, "batch": 3},
        num_waiting_by_class={"interactive": 1, "batch": 6},
        num_preemptions_by_class={"interactive": 1, "batch": 3},
        num_kv_blocks_reserved_interactive=12,
        batch_token_budget=29,
        ttft_sum_s_by_class={"interactive": 1.5, "batch": 40.25},
        ttft_count_by_class={"interactive": 3, "batch": 7},
    )
    text = generate_latest(Metrics(lambda: stats).registry).decode()
    names = (
        "tokenfleet_num_requests_running_by_class",
        "tokenfleet_num_requests_waiting_by_class",
        "tokenfleet_preemptions_by_class_total",
        "tokenfleet_engine_time_to_first_token_seconds",
        "tokenfleet_kv_blocks_reserved_interactive",
        "tokenfleet_batch_token_budget",
    )
    lines = [line for line in text.splitlines() if line.startswith(names)]
    assert lines == [
        'tokenfleet_num_requests_running_by_class{class="interactive"} 2.0',
        'tokenfleet_num_requests_running_by_class{class="batch"} 3.0',
        'tokenfleet_num_requests_waiting_by_class{class="interactive"} 1.0',
        'tokenfleet_num_requests_waiting_by_class{class="batch"} 6.0',
        'tokenfleet_preemptions_by_class_total{class="interactive"} 1.0',
        'tokenfleet_preemptions_by_class_total{class="batch"} 3.0',
        'tokenfleet_engine_time_to_first_token_seconds_count{class="interactive"} 3.0',
        'tokenfleet_engine_time_to_first_token_seconds_sum{class="interactive"} 1.5',
        'tokenfleet_engine_time_to_first_token_seconds_count{class="batch"} 7.0',
        'tokenfleet_engine_time_to_first_token_seconds_sum{class="batch"} 40.25',
        "tokenfleet_kv_blocks_reserved_interactive 12.0",
        "tokenfleet_batch_token_budget 29.0",
    ]
    # Before any step with batch work there is no budget to report.
    empty = SchedulerStats(0, 0, 0, 10, 0, 0, 0, 0)
    text = generate_latest(Metrics(lambda: empty).registry).decode()
    assert "tokenfleet_batch_token_budget " not in text


@pytest.mark.parametrize(
    ("policy", "first_step", "second_step"),
    [
        # priority: the later interactive prompt goes first; batch gets what the harvest
        # budget leaves: the step's other 216 tokens, within the limit as the hand-set
        # step model prices them.
        ("priority", {"i0": 40, "b0": 216}, None),
        # fcfs: arrival order alone, no harvest budget: the earlier batch prompt fills the
        # step, the interactive one waits behind it.
        ("fcfs", {"b0": 256}, {"b0": 44, "i0": 40}),
    ],
)
@pytest.mark.fake("runner")
def test_fixed_runner_fcfs_policy_is_arrival_order_without_a_harvest_budget(
    model_folder: Path,
    policy: str,
    first_step: dict[str, int],
    second_step: dict[str, int] | None,
) -> None:
    engine, outs = _recording_engine(_engine_config(model_folder, 256, scheduling_policy=policy))
    engine.add_request(_request("b0", [100] * 300, 4, PRIORITY_BATCH))
    engine.add_request(_request("i0", [200] * 40, 4, PRIORITY_INTERACTIVE))
    engine.step(0.0)
    engine.step(0.05)
    assert {s.req_id: s.num_tokens for s in outs[0].scheduled} == first_step
    if policy == "fcfs":
        assert {s.req_id: s.num_tokens for s in outs[1].scheduled} == second_step
        assert engine.last_batch_token_budget is None  # never asked
    # Either way the stats count each request in the class it came as (the batch
    # dispatcher sizes its leases by the engine's running batch requests).
    stats = engine.stats()
    assert stats.num_running_by_class == {"interactive": 1, "batch": 1}
    engine.add_request(_request("b1", [300] * 20, 4, PRIORITY_BATCH))
    assert engine.stats().num_waiting_by_class == {"interactive": 0, "batch": 1}
    engine.abort(["b1"])
    while engine.has_unfinished_requests():
        engine.step(0.1)
    stats = engine.stats()
    assert (
        stats.num_running_by_class == stats.num_waiting_by_class == {"interactive": 0, "batch": 0}
    )
    assert engine.fcfs_batch_ids == set()
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


def test_reachability_is_the_reference_models_not_a_drifted_fit() -> None:
    """The engine asks its start-up profile's fit whether one decode meets the target:
    an online fit that drifted (its fixed cost past the target, as a window of alike steps
    allows) must not uncut prompts beside streams."""
    decoding, late = _req("d", 41, 40), _req("late", 70_000, 60_000)
    drifted = HandSetStepModel(5 * 2**20, B, C, D, E)  # a step's fixed cost over TARGET
    assert drifted.predict(StepFeatures.of_chunk(1, 0)) > TARGET
    common = {
        "max_num_seqs": 8,
        "block_size": 16,
        "tpot_target_s": TARGET,
        "margin": MARGIN,
        "max_tokens": 512,
        "min_tokens": 16,
    }
    assert prefill_budget(drifted, [decoding, late], (), **common) is None
    assert prefill_budget(drifted, [decoding, late], (), **common, reference=MODEL) == 1
    # And the other way: a reference that cannot meet the target leaves prompts uncut.
    assert prefill_budget(MODEL, [decoding, late], (), **common) == 1
    assert prefill_budget(MODEL, [decoding, late], (), **common, reference=drifted) is None
