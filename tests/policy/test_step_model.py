"""The step-time model: features of a step, the non-negative fit, the online refit with
its prior, the start-up profile (on the real model too), and the /metrics gauges."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from tokenfleet.config import CacheConfig, EngineConfig
from tokenfleet.core.block_pool import BlockPool
from tokenfleet.core.engine_api import EngineCoreRequest, SchedulerStats
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.step_profile import ProfileStep, profile_plan, run_profile
from tokenfleet.policy.step_model import (
    TERMS,
    StepFeatures,
    StepModelConfig,
    StepSample,
    StepTimeModel,
    fit_coefficients,
    nnls,
    step_features,
)
from tokenfleet.server.metrics import Metrics

# Seconds: per step, per prefill token, per decode, per KV token read, per query x context.
TRUE = np.array([0.04, 2e-3, 3e-3, 5e-6, 6e-7])


def _chunk(req_id: str, num_tokens: int, start_pos: int, *, sample: bool) -> ScheduledRequest:
    return ScheduledRequest(req_id, [7] * num_tokens, start_pos, [], True, sample, SamplingParams())


def _grid() -> list[StepFeatures]:
    """Steps as a scheduler makes them: decode batches, prefill chunks, and mixes."""
    steps = []
    for decodes, context, prefill, start in itertools.product(
        (0, 1, 8, 32), (16, 512, 2048), (0, 32, 256), (0, 1024)
    ):
        f = sum(
            [StepFeatures.of_chunk(1, context - 1)] * decodes,
            StepFeatures.of_chunk(prefill, start) if prefill else StepFeatures(),
        )
        if f != StepFeatures():
            steps.append(f)
    return steps


def _plan(
    *,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 64,
    max_model_len: int = 2048,
    num_free_blocks: int = 300,
) -> list[ProfileStep]:
    return profile_plan(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        num_free_blocks=num_free_blocks,
        block_size=16,
    )


def _profile_steps() -> list[StepFeatures]:
    """The steps of the default start-up profile, warm-up left out."""
    plan = _plan(max_model_len=8192, num_free_blocks=10_000)
    return [
        sum((StepFeatures.of_chunk(n, s) for n, s in step), StepFeatures()) for step in plan[1:]
    ]


def _samples(coef: np.ndarray, steps: list[StepFeatures], noise: float = 0.0) -> list[StepSample]:
    rng = np.random.default_rng(0)
    return [
        StepSample(f, float(f.vector() @ coef) * (1 + noise * rng.standard_normal())) for f in steps
    ]


# -- features ------------------------------------------------------------------------------


def test_features_of_a_hand_built_step() -> None:
    so = SchedulerOutput(
        scheduled=[
            _chunk("decode", 1, 40, sample=True),  # context 41
            _chunk("decode-2", 1, 9, sample=True),  # context 10
            _chunk("first-chunk", 64, 0, sample=False),  # 64 x 64
            _chunk("last-chunk", 20, 64, sample=True),  # 20 x 84
            _chunk("one-token-chunk", 1, 100, sample=False),  # runs as a decode
        ],
        finished_req_ids=frozenset(),
        preempted_req_ids=(),
    )
    assert step_features(so) == StepFeatures(
        prefill_tokens=84,
        decode_seqs=3,
        kv_tokens_read=41 + 10 + 64 + 84 + 101,
        prefill_attention=64 * 64 + 20 * 84,
    )
    assert step_features(SchedulerOutput([], frozenset(), ())) == StepFeatures()


def test_features_add_up_over_requests() -> None:
    total = StepFeatures.of_chunk(1, 30) + StepFeatures.of_chunk(16, 16)
    assert total == StepFeatures(16, 1, 31 + 32, 16 * 32)
    assert total.vector().tolist() == [1.0, 16, 1, 63, 512]
    assert total.values() == (1, 16, 1, 63, 512)
    assert StepFeatures.of_chunks([(1, 30), (16, 16)]) == total
    assert StepFeatures.of_chunks([]) == StepFeatures()


# -- the fit -------------------------------------------------------------------------------


def test_fit_recovers_known_coefficients_from_noisy_steps() -> None:
    coef = fit_coefficients(_samples(TRUE, _grid(), noise=0.01))
    np.testing.assert_allclose(coef, TRUE, rtol=0.05)
    exact = fit_coefficients(_samples(TRUE, _grid()))
    np.testing.assert_allclose(exact, TRUE, rtol=1e-9)


def test_fit_without_a_term_leaves_it_at_zero() -> None:
    coef = fit_coefficients(_samples(TRUE, _grid()), terms=TERMS[:-1])
    assert coef[-1] == 0.0
    assert (coef[:-1] > 0).all()


def test_nnls_matches_the_best_non_negative_subset_solution() -> None:
    """NNLS's optimum is the least-squares solution on some subset of columns that is
    non-negative; brute force over all subsets finds it."""
    rng = np.random.default_rng(1)
    for _ in range(50):
        a = rng.standard_normal((12, 4))
        b = rng.standard_normal(12)
        best, best_cost = np.zeros(4), float(b @ b)
        for k in range(1, 5):
            for cols in itertools.combinations(range(4), k):
                x = np.zeros(4)
                x[list(cols)] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
                cost = float(np.sum((a @ x - b) ** 2))
                if (x >= 0).all() and cost < best_cost:
                    best, best_cost = x, cost
        x = nnls(a, b)
        assert (x >= 0).all()
        np.testing.assert_allclose(x, best, atol=1e-9)


def test_fit_never_goes_negative_when_time_falls_with_a_term() -> None:
    # Measured time falls as the context grows: least squares would give kv a negative
    # slope; the fit pins it at zero instead.
    steps = [StepFeatures.of_chunk(1, c) for c in (16, 256, 1024, 2048)]
    samples = [StepSample(f, 0.05 - 1e-6 * f.kv_tokens_read) for f in steps]
    coef = fit_coefficients(samples)
    assert (coef >= 0).all()
    assert coef[TERMS.index("kv_tokens_read")] == 0.0
    assert coef[TERMS.index("intercept")] + coef[TERMS.index("decode_seqs")] > 0


def test_step_model_config_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="terms must include 'intercept'"):
        StepModelConfig(terms=("prefill_tokens",))
    with pytest.raises(ValueError, match="terms must include 'intercept'"):
        StepModelConfig(terms=("intercept", "batch_size"))
    with pytest.raises(ValueError, match="window must be at least 1, got 0"):
        StepModelConfig(window=0)


# -- online --------------------------------------------------------------------------------


def test_the_profiles_own_fit_stays_while_the_online_fit_moves() -> None:
    model = StepTimeModel(StepModelConfig(window=64))
    assert model.profiled is None and model.profile_coefficients == {}
    model.set_prior(_samples(TRUE, _profile_steps()))
    assert model.profiled is not None
    np.testing.assert_allclose(model.profiled.coefficients, TRUE, rtol=1e-9)
    assert list(model.profile_coefficients) == list(TERMS)
    # Steps twice as slow as the profile: the online fit follows, the profile's does not.
    slow = [StepFeatures.of_chunk(1, c) for c in (15, 255, 1023)] * 30
    for s in _samples(TRUE * 2, slow):
        model.observe(s.features, s.seconds)
    f = StepFeatures.of_chunk(1, 255)
    assert model.predict(f) == pytest.approx(2 * float(f.vector() @ TRUE), rel=0.05)
    assert model.profiled.predict(f) == pytest.approx(float(f.vector() @ TRUE), rel=1e-9)


def test_online_refit_follows_a_change_within_its_window_and_keeps_the_prior() -> None:
    model = StepTimeModel(StepModelConfig(window=64, refit_interval=8))
    model.set_prior(_samples(TRUE, _profile_steps()))
    np.testing.assert_allclose(list(model.coefficients.values()), TRUE, rtol=1e-9)

    # Decodes get 2x as expensive (say, a neighbour now shares the memory bus); only
    # decode batches run for a while, no prefill at all.
    changed = TRUE * np.array([1, 1, 2, 2, 1])
    decode_steps = [
        sum([StepFeatures.of_chunk(1, c - 1)] * n, StepFeatures())
        for n, c in itertools.product((1, 4, 16, 64), (32, 256, 1024, 4096))
    ]
    for s in _samples(changed, decode_steps * 4):  # one window's worth
        model.observe(s.features, s.seconds)
    assert model.num_observed == 64
    assert len(model.samples) == 64
    for f in decode_steps:
        assert model.predict(f) == pytest.approx(float(f.vector() @ changed), rel=0.05)
    # The prefill slopes, unseen since the profile, are still (nearly) the profile's.
    coef = model.coefficients
    assert coef["prefill_tokens"] == pytest.approx(TRUE[1], rel=0.05)
    assert coef["prefill_attention"] == pytest.approx(TRUE[4], rel=0.05)
    # Without the prior the fit would know nothing of prefill.
    assert fit_coefficients(model.samples)[TERMS.index("prefill_tokens")] == 0.0


def test_without_a_profile_the_first_fit_waits_for_enough_steps() -> None:
    model = StepTimeModel(StepModelConfig(profile=False, refit_interval=1000))
    steps = _samples(TRUE, _grid())
    assert model.predict(steps[0].features) == 0.0
    for s in steps[: len(TERMS) - 1]:
        model.observe(s.features, s.seconds)
    assert not model.fitted
    assert model.prediction_error_quantiles() is None
    model.observe(steps[len(TERMS) - 1].features, steps[len(TERMS) - 1].seconds)
    assert model.fitted


def test_prediction_error_quantiles_of_given_steps() -> None:
    model = StepTimeModel(StepModelConfig(window=200, refit_interval=1000, bias_weight=0))
    model.set_prior(_samples(TRUE, _grid()))
    assert model.prediction_error_quantiles() is None
    f = StepFeatures.of_chunk(1, 99)
    predicted = model.predict(f)
    # Relative errors 0.00, 0.01, ..., 1.00, measured under and over the prediction in turn.
    for i in range(101):
        error = i / 100
        model.observe(f, predicted / (1 + error) if i % 2 == 0 else predicted / (1 - error))
    assert model.prediction_error_quantiles() == pytest.approx([0.5, 0.99], abs=1e-12)


def test_error_quantiles_cover_only_the_last_window_of_steps() -> None:
    model = StepTimeModel(StepModelConfig(window=4, refit_interval=1000, bias_weight=0))
    model.set_prior(_samples(TRUE, _grid()))
    f = StepFeatures.of_chunk(1, 99)
    predicted = model.predict(f)
    for error in (5.0, 5.0, 0.1, 0.2, 0.3, 0.4):  # the two 5.0s fall out of the window
        model.observe(f, predicted / (1 + error))
    quantiles = model.prediction_error_quantiles((0, 0.5, 1))
    assert quantiles == pytest.approx([0.1, 0.25, 0.4], abs=1e-12)


def test_predictions_follow_a_slow_spell_by_the_recent_bias() -> None:
    """A spell of steps 1.3x the fit (the fit held still): each prediction is the fit's
    times an average of the recent measured/fitted ratios, weight 0.2 on the newest; the
    error recorded is the scaled prediction's; the coefficients others price steps with
    carry the same scale; one 10x stall counts as 2x."""
    model = StepTimeModel(StepModelConfig(refit_interval=1000))
    model.set_prior(_samples(TRUE, _grid()))
    f = StepFeatures.of_chunk(1, 99)
    fitted = float(f.vector() @ TRUE)
    assert model.bias == 1.0 and model.predict(f) == pytest.approx(fitted, rel=1e-9)
    bias = 1.0
    for n in range(1, 11):
        model.observe(f, 1.3 * fitted)
        error = abs(bias - 1.3) / 1.3  # against the prediction made before this step
        assert model._errors[n - 1] == pytest.approx(error, rel=1e-9)
        bias += 0.2 * (1.3 - bias)
        assert model.bias == pytest.approx(1.3 - 0.3 * 0.8**n, rel=1e-12)
        assert model.predict(f) == pytest.approx(bias * fitted, rel=1e-9)
    coef = model.coefficients
    assert list(coef.values()) == pytest.approx(list(TRUE * bias), rel=1e-9)
    assert model.profile_coefficients == pytest.approx(dict(zip(TERMS, TRUE, strict=True)))
    model.observe(f, 10 * fitted)
    assert model.bias == pytest.approx(bias + 0.2 * (2.0 - bias), rel=1e-12)
    # Weight 0: the fit's predictions as they are.
    plain = StepTimeModel(StepModelConfig(refit_interval=1000, bias_weight=0))
    plain.set_prior(_samples(TRUE, _grid()))
    for _ in range(5):
        plain.observe(f, 1.3 * fitted)
    assert plain.bias == 1.0 and plain.predict(f) == pytest.approx(fitted, rel=1e-9)
    with pytest.raises(ValueError, match="bias_weight"):
        StepModelConfig(bias_weight=1.5)


# -- the start-up profile ------------------------------------------------------------------


def test_profile_plan_is_cut_to_the_engine_limits() -> None:
    plan = _plan(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=160, num_free_blocks=10)
    assert plan == [
        [(16, 0)],  # the warm-up
        [(1, 15)],
        [(64, 0)],  # 128 tokens, cut to the token budget
        [(1, 63)] * 2,  # 32 decodes, cut to the 10 blocks
        [(1, 159)],  # 16 decodes at 1024, contexts capped at max_model_len
        [(64, 96)],  # the chunk at 960, moved back to fit
        [(32, 0)],
        [(16, 0)],  # the rest cut down to repeats of the above, dropped
    ]


class _FakeRunner:
    """Takes `cost(features)` seconds of a fake clock per step; checks the block tables."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.now = 0.0
        self.pool = pool
        self.block_size = block_size
        self.steps: list[SchedulerOutput] = []

    def clock(self) -> float:
        return self.now

    def execute(self, so: SchedulerOutput) -> None:
        assert all(s.new_table for s in so.scheduled)  # the profile's tables, whole each step
        used = [b for s in so.scheduled for b in s.new_block_ids]
        assert len(used) == len(set(used)), "a block given to two requests"
        assert all(self.pool.blocks[b].ref_cnt == 1 for b in used)
        for s in so.scheduled:
            assert len(s.new_block_ids) == -(-(s.start_pos + s.num_tokens) // self.block_size)
        self.steps.append(so)
        self.now += float(step_features(so).vector() @ TRUE)


@pytest.mark.fake("runner")
def test_profile_times_each_step_and_leaves_the_pool_as_it_found_it_on_a_fake_runner() -> None:
    pool = BlockPool(300)
    pool.get_new_blocks(3)  # blocks 0..2 stay in use throughout
    before = [b.block_id for b in pool.free_queue]
    plan = _plan(num_free_blocks=pool.num_free_blocks)
    runner = _FakeRunner(pool, 16)
    samples = run_profile(runner.execute, pool, 16, plan, max_seconds=100.0, clock=runner.clock)
    assert len(runner.steps) == len(plan)
    assert [s.features for s in samples] == [step_features(so) for so in runner.steps[1:]]
    for s in samples:
        assert s.seconds == pytest.approx(float(s.features.vector() @ TRUE), rel=1e-12)
    assert [b.block_id for b in pool.free_queue] == before
    assert pool.num_free_blocks == 297
    assert pool.num_cached_blocks == 0
    np.testing.assert_allclose(fit_coefficients(samples), TRUE, rtol=1e-6)


@pytest.mark.fake("runner")
def test_profile_skips_steps_that_would_run_past_its_time_cap_on_a_fake_runner() -> None:
    pool = BlockPool(300)
    plan = _plan()
    runner = _FakeRunner(pool, 16)
    samples = run_profile(runner.execute, pool, 16, plan, max_seconds=2.0, clock=runner.clock)
    # By the 256-token prefill (0.59 s) 1.70 s had gone: it and the 512-token one (1.22 s)
    # are skipped, the cheaper steps after them still run.
    ran = [[(s.num_tokens, s.start_pos) for s in so.scheduled] for so in runner.steps]
    assert ran == [step for step in plan if step not in ([(256, 0)], [(512, 0)])]
    assert runner.now == pytest.approx(1.8398192, rel=1e-9)
    assert len(samples) == len(ran) - 1
    assert pool.num_free_blocks == 300


def test_profile_on_the_bundled_model(model_folder: Path) -> None:
    config = EngineConfig(
        model=str(model_folder), num_threads=1, cache=CacheConfig(kv_cache_memory=64 << 20)
    )
    engine = EngineCore(config)
    pool = engine.kv.pool
    assert len(engine.step_model.prior) >= len(TERMS)
    coef = engine.step_model.coefficients
    assert coef["prefill_tokens"] > 0
    assert coef["decode_seqs"] > 0
    # The pool is as a fresh one: every block free, in id order, nothing cached.
    assert [b.block_id for b in pool.free_queue] == list(range(pool.num_blocks))
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_cached_blocks == 0
    assert pool.num_evictions == 0


# -- the engine and /metrics ---------------------------------------------------------------


@pytest.mark.fake("runner")
def test_fixed_runner_engine_steps_feed_the_model_and_stats_carry_it(model_folder: Path) -> None:
    engine = EngineCore(EngineConfig(model=str(model_folder), runner="fixed"))
    assert engine.step_model.prior == []  # nothing to profile
    stats = engine.stats()
    assert (stats.step_time_error_p50, stats.step_time_error_p99) == (None, None)
    engine.add_request(
        EngineCoreRequest("a", [5] * 40, SamplingParams(max_tokens=10, ignore_eos=True), 0.0)
    )
    engine.add_request(
        EngineCoreRequest("b", [6] * 3, SamplingParams(max_tokens=4, ignore_eos=True), 0.0)
    )
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    stats = engine.step().stats  # an empty step: no sample
    assert stats is not None
    model = engine.step_model
    assert model.num_observed == num_steps
    assert model.samples[0].features == StepFeatures(
        prefill_tokens=43, kv_tokens_read=43, prefill_attention=40 * 40 + 3 * 3
    )
    assert model.samples[-1].features == StepFeatures(decode_seqs=1, kv_tokens_read=49)
    assert stats.step_time_coefficients == model.coefficients
    assert [stats.step_time_error_p50, stats.step_time_error_p99] == (
        model.prediction_error_quantiles()
    )


def test_metrics_export_the_step_model() -> None:
    stats = SchedulerStats(
        num_running=0,
        num_waiting=0,
        num_kv_blocks_used=0,
        num_kv_blocks_total=10,
        num_prefix_query_tokens=0,
        num_prefix_hit_tokens=0,
        num_preemptions=0,
        num_steps=0,
        step_time_error_p50=0.125,
        step_time_error_p99=0.5,
        step_time_coefficients=dict(zip(TERMS, [0.04, 0.002, 0.003, 5e-06, 0.0], strict=True)),
    )
    text = generate_latest(Metrics(lambda: stats).registry).decode()
    lines = [line for line in text.splitlines() if line.startswith("tokenfleet_step_time")]
    assert lines == [
        'tokenfleet_step_time_prediction_error_ratio{quantile="0.5"} 0.125',
        'tokenfleet_step_time_prediction_error_ratio{quantile="0.99"} 0.5',
        'tokenfleet_step_time_model_coefficient{term="intercept"} 0.04',
        'tokenfleet_step_time_model_coefficient{term="prefill_tokens"} 0.002',
        'tokenfleet_step_time_model_coefficient{term="decode_seqs"} 0.003',
        'tokenfleet_step_time_model_coefficient{term="kv_tokens_read"} 5e-06',
        'tokenfleet_step_time_model_coefficient{term="prefill_attention"} 0.0',
    ]
    # Before the first prediction there is no error to report, only the coefficients.
    empty = SchedulerStats(0, 0, 0, 10, 0, 0, 0, 0)
    text = generate_latest(Metrics(lambda: empty).registry).decode()
    assert "tokenfleet_step_time_prediction_error_ratio{" not in text
