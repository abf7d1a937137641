"""The fleet simulator: its cost models, that it drives the engine's own Scheduler, that a
leap over repeated decode steps equals stepping, that a seed fixes a run bit for bit, the
workload and trace, router, leasing, autoscaler and the three fleet policies."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

import tokenfleet.core.scheduler
import tokenfleet.sim.dispatch
from tokenfleet.core.kv_cache import KVCacheManager
from tokenfleet.fleet.autoscaler import Autoscaler, FleetWindow
from tokenfleet.fleet.leasing import lease_room
from tokenfleet.fleet.router import Router, RouterConfig
from tokenfleet.loadgen.report import percentile
from tokenfleet.policy.step_model import TERMS, LinearStepCost, StepFeatures
from tokenfleet.sim.config import ConfigError, SimConfig, parse_config
from tokenfleet.sim.cost_model import RooflineCost, load_coefficients, profile_step_model
from tokenfleet.sim.dispatch import BatchBacklog, JobState, room
from tokenfleet.sim.fleet import SimSettings, Simulation
from tokenfleet.sim.hardware import deployment
from tokenfleet.sim.metrics import Targets
from tokenfleet.sim.report import format_table, plot, summarize, targets_met
from tokenfleet.sim.run import cost_models, interactive_stream, job_submissions, simulate
from tokenfleet.sim.trace import TraceError, read_trace, write_trace
from tokenfleet.sim.workload import (
    BATCH,
    INTERACTIVE,
    Arrival,
    InteractiveWorkload,
    interactive_arrivals,
    prompt_token_ids,
)

# -- cost models ---------------------------------------------------------------------


def test_llama_shapes_give_their_parameter_counts_and_kv_bytes() -> None:
    small = deployment("H200", "llama-3-8b").model
    large = deployment("H200", "llama-3-70b", 4).model
    # Llama-3-8B has 8,030,261,248 parameters, of which 266,240 are norm weights
    # (left out: they neither take FLOPs nor matter in bytes).
    assert small.num_params == 8_030_261_248 - 266_240
    assert small.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert large.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680


def test_kv_capacity_is_the_memory_the_weights_leave() -> None:
    dep = deployment("H200", "llama-3-8b")
    free = 141e9 * 0.9 - dep.model.weight_bytes - 2 * 2**30
    assert dep.kv_cache_tokens() == int(free // 131_072)
    tp4 = deployment("H200", "llama-3-70b", 4)
    free_rank = 141e9 * 0.9 - tp4.model.weight_bytes / 4 - 2 * 2**30
    assert tp4.kv_cache_tokens() == int(free_rank * 4 // 327_680)
    with pytest.raises(ValueError, match="no memory is left"):
        deployment("H100", "llama-3-70b", 1)


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    dep = deployment("H200", "llama-3-8b")
    cost = RooflineCost(dep)
    decode = StepFeatures.of_chunk(1, 1023)
    read = dep.model.weight_bytes + 1024 * 131_072
    assert cost.predict(decode) == pytest.approx(1e-3 + read / (4.8e12 * 0.8), rel=1e-12)
    prefill = StepFeatures.of_chunk(2048, 0)
    flops = 2 * dep.model.matmul_params * 2048 + 4 * 32 * 32 * 128 * (2048 * 2048 + 2048)
    assert cost.predict(prefill) == pytest.approx(1e-3 + flops / (989e12 * 0.6), rel=1e-12)


def test_tensor_parallel_pays_two_ring_all_reduces_a_layer() -> None:
    cost = RooflineCost(deployment("H200", "llama-3-70b", 4))
    one = 10e-6 + 2 * 3 / 4 * (8 * 8192 * 2) / (450e9 * 0.7)
    assert cost.all_reduce_s(8) == pytest.approx(2 * 80 * one, rel=1e-12)
    assert RooflineCost(deployment("H200", "llama-3-8b")).all_reduce_s(8) == 0.0


def test_fitted_coefficients_load_from_json_and_a_profile_fit_recovers_them(
    tmp_path: Path,
) -> None:
    coefficients = dict(zip(TERMS, (5e-3, 2e-5, 1e-4, 3e-8, 1e-10), strict=True))
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"coefficients": coefficients}))
    cost = load_coefficients(path)
    assert cost == LinearStepCost(tuple(coefficients.values()))
    f = StepFeatures(prefill_tokens=10, decode_seqs=3, kv_tokens_read=100, prefill_attention=7)
    assert cost.predict(f) == pytest.approx(5e-3 + 2e-4 + 3e-4 + 3e-6 + 7e-10, rel=1e-12)
    fitted = profile_step_model(cost, 2048, 64, 8192).coefficients
    assert fitted == pytest.approx(coefficients, rel=1e-6)
    path.write_text(json.dumps({"slope": 1.0}))
    with pytest.raises(ValueError, match="unknown terms"):
        load_coefficients(path)


# -- a small fleet -------------------------------------------------------------------


def small_config(**overrides: Any) -> SimConfig:
    """Two H200 replicas of Llama-3-8B with a tiny KV cache (so blocks run short), a
    few interactive requests a second and one batch job."""
    data: dict[str, Any] = {
        "seed": 3,
        "duration_s": 40.0,
        "accelerator": "H200",
        "model": "llama-3-8b",
        "replica": {"num_kv_blocks": 2000, "max_num_seqs": 32, "max_model_len": 4096},
        "interactive": {
            "peak_rate": 4.0,
            "lengths": {"prompt_median": 300, "output_median": 200, "max_model_len": 4096},
            "prompts": {"count": 3, "length": 64, "share": 0.8},
        },
        "batch_jobs": [
            {
                "num_requests": 60,
                "submit_s": 2.0,
                "lengths": {"prompt_median": 400, "output_median": 300, "max_model_len": 4096},
            }
        ],
        "policies": [{"name": "priority", "replicas": 2}],
        "sample_s": 5.0,
    }
    data.update(overrides)
    return parse_config(data)


def run_small(
    config: SimConfig, *, leap: bool = True, policy: int = 0, **replica: Any
) -> Simulation:
    from dataclasses import replace

    cost, model = cost_models(config)
    settings = SimSettings(
        replica=replace(config.replica, leap=leap, **replica),
        duration_s=config.duration_s,
        sample_s=config.sample_s,
    )
    sim = Simulation(
        config.policies[policy],
        settings,
        cost,
        model,
        interactive_stream(config),
        job_submissions(config),
    )
    sim.run()
    return sim


def outcome(sim: Simulation) -> dict[str, Any]:
    """Everything a run reports, exactly."""
    m = sim.metrics
    return {
        "classes": {
            k: (list(c.ttft_s), list(c.tpot_s), c.num_finished, c.num_unfinished, c.output_tokens)
            for k, c in m.classes.items()
        },
        "samples": [(s.time_s, s.replicas, s.kv_usage) for s in m.samples],
        "accelerator_s": m.accelerator_s,
        "jobs": [(j.num_done, j.last_done_at) for j in sim.jobs],
    }


def test_the_simulator_drives_the_engines_own_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    real = tokenfleet.core.scheduler.Scheduler.schedule

    def observed(self: tokenfleet.core.scheduler.Scheduler, now: float, **kw: Any) -> Any:
        calls.append(now)
        return real(self, now, **kw)

    monkeypatch.setattr(tokenfleet.core.scheduler.Scheduler, "schedule", observed)
    sim = run_small(small_config(duration_s=10.0), leap=False)
    replicas = [r for pool in sim.pools for r in pool.replicas.values()]
    assert [type(r.scheduler) for r in replicas] == [tokenfleet.core.scheduler.Scheduler] * 2
    assert [type(r.kv) for r in replicas] == [KVCacheManager] * 2
    # Every step the simulator took was planned by that method (stepping, no leaps).
    assert len(calls) == sum(r.scheduler.num_steps for r in replicas) > 100
    assert sim.metrics.classes[INTERACTIVE].num_finished > 0


@pytest.mark.parametrize(
    ("policy", "batch_step_limit_s"), [("priority", None), ("priority", 0.01), ("fcfs", None)]
)
def test_leaping_equals_stepping(policy: str, batch_step_limit_s: float | None) -> None:
    # Long enough for everything to finish: the blocks held at the end compare too.
    config = small_config(duration_s=200.0, policies=[{"name": policy, "replicas": 2}])
    limit = {"batch_step_limit_s": batch_step_limit_s}
    stepped = run_small(config, leap=False, **limit)
    leapt = run_small(config, leap=True, **limit)
    replicas = [r for pool in leapt.pools for r in pool.replicas.values()]
    assert sum(r.num_leap_steps for r in replicas) > 1000  # it did leap
    assert sum(r.num_cuts for r in replicas) > 10  # and arrivals cut leaps short
    assert outcome(leapt) == outcome(stepped)
    assert leapt.metrics.num_steps == stepped.metrics.num_steps
    if batch_step_limit_s is not None:  # and the limit bound: not the run without it
        assert outcome(leapt) != outcome(run_small(config))
    for a, b in zip([r for p in stepped.pools for r in p.replicas.values()], replicas, strict=True):
        assert a.kv.pool.num_free_blocks == b.kv.pool.num_free_blocks
        assert a.kv.pool.num_cached_blocks == b.kv.pool.num_cached_blocks
        assert a.scheduler.num_preemptions == b.scheduler.num_preemptions


def test_a_seed_fixes_the_run_bit_for_bit() -> None:
    config = small_config(duration_s=20.0)
    first, second = outcome(run_small(config)), outcome(run_small(config))
    assert first == second
    assert first["classes"][INTERACTIVE][2] > 10
    other = outcome(run_small(small_config(duration_s=20.0, seed=4)))
    assert other["classes"][INTERACTIVE][0] != first["classes"][INTERACTIVE][0]


def test_the_three_policies_run_on_the_same_workload() -> None:
    config = small_config(
        duration_s=30.0,
        policies=[
            {"name": "separate", "replicas": 2, "interactive_replicas": 1},
            {"name": "fcfs", "replicas": 2},
            {"name": "priority", "replicas": 2},
        ],
    )
    results = [simulate(config, policy) for policy in config.policies]
    assert [r.policy.name for r in results] == ["separate", "fcfs", "priority"]
    interactive = [r.metrics.classes[INTERACTIVE].num_finished for r in results]
    batch = [r.metrics.classes[BATCH].num_finished for r in results]
    assert min(interactive) > 20 and min(batch) > 0
    separate = run_small(config, policy=0)
    interactive_pool, batch_pool = separate.pools
    assert interactive_pool.batch_in_flight == {0: 0}  # no batch request ever leased there
    assert [r.scheduler.num_steps > 0 for r in batch_pool.replicas.values()] == [True]
    # FCFS: one class on the replica, so batch is never held to a harvest budget.
    fcfs = run_small(config, policy=1)
    assert {r.config.policy for p in fcfs.pools for r in p.replicas.values()} == {"fcfs"}


# -- workload and trace ---------------------------------------------------------------


def test_arrivals_follow_the_daily_curve() -> None:
    curve = tuple([1.0] * 12 + [0.25] * 12)
    workload = InteractiveWorkload(peak_rate=2.0, daily_curve=curve)
    arrivals = list(interactive_arrivals(workload, 86400.0, seed=0))
    day = sum(a.arrival_s < 43200 for a in arrivals)
    night = len(arrivals) - day
    # Poisson counts: 86,400 and 21,600 expected, within 5 standard deviations.
    assert abs(day - 86400) < 5 * math.sqrt(86400)
    assert abs(night - 21600) < 5 * math.sqrt(21600)
    assert all(4 <= a.prompt_len <= 4000 and a.output_len >= 4 for a in arrivals)
    shared = [a for a in arrivals if a.prefix_id >= 0]
    assert 0.75 < len(shared) / len(arrivals) < 0.85


def test_shared_prompts_share_blocks_and_own_parts_never_collide() -> None:
    a = Arrival(1, INTERACTIVE, 0.0, 100, 10, prefix_id=2, prefix_len=64)
    b = Arrival(2, INTERACTIVE, 0.0, 90, 10, prefix_id=2, prefix_len=64)
    c = Arrival(1, BATCH, 0.0, 100, 10)
    pa, pb, pc = prompt_token_ids(a), prompt_token_ids(b), prompt_token_ids(c)
    assert pa[:64] == pb[:64] and len(pa) == 100 and len(pb) == 90
    assert not set(pa[64:]) & set(pb[64:]) and not set(pa) & set(pc)


def test_a_trace_replays_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    arrivals = [
        (Arrival(1, INTERACTIVE, 0.5, 300, 20, 2, 64), None),
        (Arrival(2, BATCH, 1.0, 500, 40, job_id=7), 3600.0),
    ]
    assert write_trace(path, arrivals) == 2
    assert list(read_trace(path)) == arrivals
    path.write_text(
        '{"t": 1, "kind": "interactive", "prompt_tokens": 5, "output_tokens": 1}\n'
        '{"t": 0, "kind": "interactive", "prompt_tokens": 5, "output_tokens": 1}\n'
    )
    with pytest.raises(TraceError, match=r"trace.jsonl:2: t goes backwards"):
        list(read_trace(path))
    path.write_text('{"t": 1, "kind": "chat", "prompt_tokens": 5, "output_tokens": 1}\n')
    with pytest.raises(TraceError, match=r":1: kind must be"):
        list(read_trace(path))


def test_a_trace_drives_a_simulation(tmp_path: Path) -> None:
    rng = random.Random(0)
    lines = [
        (Arrival(i, INTERACTIVE, i * 0.5, rng.randint(50, 400), 30, 0, 32), None) for i in range(20)
    ]
    lines += [(Arrival(100 + i, BATCH, 12.0, 200, 50, job_id=1), 600.0) for i in range(10)]
    lines.sort(key=lambda pair: pair[0].arrival_s)
    write_trace(tmp_path / "t.jsonl", lines)
    config = small_config(duration_s=60.0, trace=str(tmp_path / "t.jsonl"))
    result = simulate(config, config.policies[0])
    assert result.metrics.classes[INTERACTIVE].num_finished == 20
    assert [(j.num_requests, j.num_done, j.deadline_at) for j in result.jobs] == [(10, 10, 612.0)]


# -- router, leasing, autoscaler -------------------------------------------------------


def test_router_follows_the_prefix_unless_the_replica_is_too_busy() -> None:
    router = Router(RouterConfig(decode_weight=16, max_imbalance=2), block_size=16)
    for r in (0, 1, 2):
        router.add_replica(r)
    system = list(range(1000, 1512))  # 32 blocks
    assert router.route([*system, 1, 2, 3], [0, 1, 2]) == (0, 515)  # all equal: lowest id
    # Before 0 has prefilled it, the prompt counts against 0.
    assert router.route([5] * 100, [0, 1, 2]) == (1, 100)
    assert router.route([*system, 7, 8], [0, 1, 2]) == (2, 514)
    router.prefilled(0, 515)
    # 0: 2 uncached + 16 a request; 2: 2 uncached + 514 queued + 16.
    assert router.route([*system, 9], [0, 1, 2]) == (0, 1)
    assert router.route([*system, 10], [0, 1, 2]) == (0, 1)
    assert router.route([*system, 11], [0, 1, 2]) == (0, 1)
    # 0 now has 4 requests, 1 and 2 one each: over max_imbalance (2), affinity gives way
    # (2 holds the prefix too, and its queue is shorter than 1's whole prompt).
    assert router.route([*system, 12], [0, 1, 2]) == (2, 1)
    router.finished(0)
    assert router.views[0].num_requests == 3
    assert router.queued_prefill_tokens == (1 + 1 + 1) + 100 + (514 + 1)


@pytest.mark.fake("lease_room")
def test_leasing_is_the_dispatchers_rule_called_through_a_fake_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Equal to the real rule; then, with a stand-in in its place, the simulator is seen
    to call it (and not a copy of it)."""
    for args in [(0, 0, 0), (10, 8, 2), (70, 64, 6), (3, 60, 0)]:
        assert room(*args, queue_target=8, depth=64) == lease_room(args[0], args[1:], 8, 64)
    seen: list[Any] = []
    monkeypatch.setattr(tokenfleet.sim.dispatch, "lease_room", lambda *a: seen.append(a) or 5)
    assert room(1, 2, 3, queue_target=4, depth=9) == 5
    assert seen == [(1, (2, 3), 4, 9)]


def test_backlog_leases_earliest_deadline_first() -> None:
    backlog = BatchBacklog()

    def job(job_id: int, deadline: float, n: int) -> JobState:
        arrivals = iter(
            [Arrival(job_id * 10 + i, BATCH, 0, 10, 5, job_id=job_id) for i in range(n)]
        )
        return JobState(job_id, 0.0, deadline, n, 5, arrivals)

    backlog.submit(job(1, 500.0, 3))
    backlog.submit(job(2, 100.0, 2))
    assert [a.index for a in backlog.take(4)] == [20, 21, 10, 11]
    assert backlog.num_unleased == 1
    assert [a.index for a in backlog.take(4)] == [12]
    assert not backlog


def test_autoscaled_pool_grows_under_load_without_asking_twice_for_a_starting_replica() -> None:
    """The simulator runs the fleet's `Autoscaler` with the windows' time and starting
    replicas: replicas take 25 s to start, windows are 10 s, so each one asked for is
    starting for two windows, in which the same pressure adds nothing."""
    config = small_config(
        duration_s=120.0,
        interactive={"peak_rate": 40.0, "lengths": {"prompt_median": 2000, "output_median": 100}},
        autoscaler={
            "min_replicas": 1,
            "max_replicas": 8,
            "window_s": 10.0,
            "startup_s": 25.0,
            "up_cooldown_s": 0.0,
        },
        policies=[{"name": "priority", "replicas": 1}],
    )
    result = simulate(config, config.policies[0])
    decisions = [
        (d.now_s, d.num_replicas, d.num_starting, d.target, d.reason)
        for d in result.decisions["priority"]
    ]
    assert decisions[:7] == [
        (10.0, 1, 0, 2, "queue"),
        (20.0, 2, 1, 2, "starting"),
        (30.0, 2, 1, 2, "starting"),
        (40.0, 2, 0, 3, "slo"),
        (50.0, 3, 1, 3, "starting"),
        (60.0, 3, 1, 3, "starting"),
        (70.0, 3, 0, 4, "slo"),
    ]
    assert len(decisions) == 11
    # Serving replicas (sampled every 5 s) follow 25 s behind each ask, counted as
    # starting from the ask (10 s, 40 s) until they serve (35 s, 65 s).
    samples = result.metrics.samples
    assert [s.replicas[0] for s in samples][6:9] == [1, 2, 2]
    assert [s.starting[0] for s in samples][:14] == [0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0]
    assert [s.draining[0] for s in samples] == [0] * len(samples)


def test_autoscaled_batch_rate_is_measured_only_once_replicas_are_fed_and_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch rate (BatchRateMeter) counts tokens as they are generated, over windows
    with batch requests queued at both ends and the replicas up unchanged since
    `batch_settle_s` (one window here) before: a job's first windows and a replica just up
    are unmeasured (the policy holds), where counting tokens of requests ended read near
    zero and sent the pool to max_replicas (8 here: what this run did before). The tail,
    every request on a replica, is unmeasured too: more replicas cannot make it sooner."""
    windows: list[FleetWindow] = []
    decide = Autoscaler.decide

    def recording(self: Autoscaler, window: FleetWindow) -> int:
        windows.append(window)
        return decide(self, window)

    monkeypatch.setattr(Autoscaler, "decide", recording)
    lengths = {"prompt_median": 400, "output_median": 1500, "max_model_len": 4096}
    config = small_config(
        duration_s=150.0,
        batch_jobs=[{"num_requests": 300, "submit_s": 12, "deadline_s": 300, "lengths": lengths}],
        autoscaler={
            "min_replicas": 1, "max_replicas": 8, "window_s": 5.0, "startup_s": 5.0,
            "up_cooldown_s": 0.0, "down_cooldown_s": 0.0, "down_windows": 2,
            "batch_settle_s": 5.0,
        },
    )  # fmt: skip
    result = simulate(config, config.policies[0])
    decisions = [(d.now_s, d.target, d.reason) for d in result.decisions["priority"]]
    assert decisions[1:8] == [
        (10.0, 1, "calm"),
        (15.0, 1, "hold"),  # the job arrived at 12 s: fed from 15 s
        (20.0, 1, "hold"),  # settling
        (25.0, 2, "deadline"),  # measured: one replica is not enough
        (30.0, 2, "hold"),  # the new replica up (and so on)
        (35.0, 2, "hold"),
        (40.0, 2, "hold"),  # measured again: two are enough
    ]
    rates = [w.batch_tokens_per_replica_s for w in windows]
    assert windows[2].batch_tokens_left > 500_000
    assert rates[2:5] == [0.0, 0.0, pytest.approx(2031, abs=1)]
    assert rates[5:7] == [0.0, 0.0] and rates[7] > 1000
    assert max(target for _, target, _ in decisions) == 2
    # The tail: nothing queued, the rate unmeasured, the policy holds (no scale-up on it).
    tail = [w for w in windows if w.batch_tokens_left > 0 and w.now_s > 95]
    assert tail and all(w.batch_tokens_per_replica_s == 0.0 for w in tail)
    (job,) = result.jobs
    assert job.num_done_in_time == 300


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"replica: unknown setting\(s\) \['max_seqs'\]"):
        small_config(replica={"max_seqs": 3})
    with pytest.raises(ConfigError, match="unknown setting"):
        small_config(colour="blue")
    with pytest.raises(ConfigError, match="policies"):
        small_config(policies=[{"name": "random", "replicas": 2}])


def test_report_summarizes_renders_and_plots(tmp_path: Path) -> None:
    config = small_config(duration_s=10.0)
    result = simulate(config, config.policies[0])
    summary = summarize(result, config.targets)
    assert summary["accelerator_hours"] == pytest.approx(2 * 10.0 / 3600)
    interactive = summary["classes"][INTERACTIVE]
    log = result.metrics.classes[INTERACTIVE]
    assert interactive["finished"] == log.num_finished > 0
    assert interactive["ttft_s"]["p50"] == percentile(list(log.ttft_s), 50)
    classes = result.metrics.classes.values()
    tokens = sum(c.prompt_tokens + c.output_tokens + c.unfinished_output_tokens for c in classes)
    # Requests running at the end count what they made by then.
    assert result.metrics.classes[BATCH].unfinished_output_tokens > 0
    assert summary["tokens_per_accelerator_hour"] == pytest.approx(tokens / (20 / 3600))
    assert summary["timeline"]["time_s"] == [0.0, 5.0]
    table = format_table([summary])
    assert table.splitlines()[2].startswith("priority  interactive")
    plot(tmp_path / "sim.png", [summary])
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"


def test_targets_are_met_only_when_all_four_percentiles_are() -> None:
    targets = Targets()
    ok = {"ttft_s": {"p50": 0.5, "p99": 2.0}, "tpot_s": {"p50": 0.04, "p99": 0.06}}
    assert targets_met(ok, targets)
    for kind, q in [("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99")]:
        worse = {k: dict(v) for k, v in ok.items()}
        worse[kind][q] *= 1.01
        assert not targets_met(worse, targets)
    assert not targets_met({"ttft_s": {"p50": None, "p99": None}, "tpot_s": ok["tpot_s"]}, targets)
