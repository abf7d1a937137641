"""Sampled fleets: k of N replicas given k/N of the traffic. The thinning is seeded and
keeps k/N of the arrivals, k = N is the full simulation exactly, totals scale back to N
while per-request distributions do not, and a bad k is refused naming the setting."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.cli.main import main as cli_main
from tokenfleet.loadgen.report import percentile
from tokenfleet.sim.config import ConfigError, SimConfig, parse_config, sampled
from tokenfleet.sim.report import format_table, summarize
from tokenfleet.sim.run import interactive_stream, job_submissions, simulate
from tokenfleet.sim.sampling import Sampling
from tokenfleet.sim.trace import write_trace
from tokenfleet.sim.workload import BATCH, INTERACTIVE, Arrival


def config(**overrides: Any) -> SimConfig:
    """Four H200 replicas of Llama-3-8B with a small KV cache, 8 interactive requests a
    second at a flat peak and one batch job."""
    data: dict[str, Any] = {
        "seed": 5,
        "duration_s": 8.0,
        "replica": {"num_kv_blocks": 2000, "max_num_seqs": 32, "max_model_len": 4096},
        "interactive": {
            "peak_rate": 8.0,
            "daily_curve": [1.0],
            "lengths": {"prompt_median": 300, "output_median": 40, "max_model_len": 4096},
            "prompts": {"count": 3, "length": 64, "share": 0.8},
        },
        "batch_jobs": [
            {
                "num_requests": 80,
                "submit_s": 1.0,
                "lengths": {"prompt_median": 400, "output_median": 60, "max_model_len": 4096},
            }
        ],
        "policies": [{"name": "priority", "replicas": 4}],
        "sample_s": 2.0,
    }
    data.update(overrides)
    return parse_config(data)


def without_wall(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_s", "sampling")}


def test_a_sample_of_all_replicas_is_the_full_simulation() -> None:
    full_config = config()
    full = simulate(full_config, full_config.policies[0])
    same = simulate(sampled(full_config, 4), full_config.policies[0])
    assert same.sampling == Sampling(4, 4)
    for kind in (INTERACTIVE, BATCH):
        a, b = full.metrics.classes[kind], same.metrics.classes[kind]
        assert (list(a.ttft_s), list(a.tpot_s)) == (list(b.ttft_s), list(b.tpot_s))
    assert full.metrics.classes[INTERACTIVE].num_finished > 20
    assert full.metrics.num_steps == same.metrics.num_steps
    targets = full_config.targets
    assert without_wall(summarize(full, targets)) == without_wall(summarize(same, targets))


def test_generated_arrivals_are_thinned_to_k_over_n_seeded() -> None:
    """A Poisson process at f of the rate is the full one thinned with probability f: the
    count is Poisson around f x 100 s x 200/s, the lengths keep their distribution."""
    base = config(duration_s=100.0, interactive={"peak_rate": 200.0, "daily_curve": [1.0]})
    sample = Sampling(1, 8)
    full = list(interactive_stream(base))
    kept = list(interactive_stream(base, sample))
    expected = 100.0 * 200.0 / 8
    assert abs(len(kept) - expected) < 4 * math.sqrt(expected)  # 2,500 +- 200
    assert len(kept) == 2_516  # this seed's draw, exactly
    assert kept == list(interactive_stream(base, sample))  # seeded: the same again
    other_seed = list(interactive_stream(replace(base, seed=6), sample))
    assert [a.arrival_s for a in other_seed[:5]] != [a.arrival_s for a in kept[:5]]
    mean_full = statistics.fmean(a.prompt_len for a in full)
    assert statistics.fmean(a.prompt_len for a in kept) == pytest.approx(mean_full, rel=0.05)
    assert list(interactive_stream(base, Sampling(8, 8))) == full


def test_a_traces_interactive_lines_are_thinned_by_the_seeds_own_stream(tmp_path: Path) -> None:
    lines: list[tuple[Arrival, float | None]] = [
        (Arrival(i, INTERACTIVE, i * 0.01, 100, 10), None) for i in range(4000)
    ]
    lines += [(Arrival(5000 + i, BATCH, 40.0, 200, 20, job_id=3), 600.0) for i in range(10)]
    write_trace(tmp_path / "t.jsonl", lines)
    base = config(trace=str(tmp_path / "t.jsonl"))
    sample = Sampling(1, 4)
    kept = list(interactive_stream(base, sample))
    # Binomial(4000, 1/4): 1,000 +- 4 standard deviations (27.4 each).
    assert abs(len(kept) - 1000) < 4 * math.sqrt(4000 * 0.25 * 0.75)
    assert len(kept) == 982  # this seed's draw, exactly
    assert kept == list(interactive_stream(base, sample))
    every = list(interactive_stream(base))
    assert set(kept) < set(every) and kept == sorted(kept, key=lambda a: a.arrival_s)
    assert list(interactive_stream(base, Sampling(4, 4))) == every
    # A trace's job: its first lines, a quarter of them (10 / 4 rounds to 2).
    (job,) = job_submissions(base, sample)
    assert (job.num_requests, job.deadline_s) == (2, 600.0)
    assert [a.index for a in job.requests()] == [4001, 4002]  # its lines, numbered from 1


def test_batch_jobs_get_k_over_n_of_their_requests_the_first_ones() -> None:
    base = config(
        batch_jobs=[
            {"num_requests": 100_000, "submit_s": 5.0, "deadline_s": 3600.0},
            {"num_requests": 3},
        ]
    )
    full = job_submissions(base)
    jobs = job_submissions(base, Sampling(3, 64))
    assert [(j.num_requests, j.submit_s, j.deadline_s) for j in jobs] == [
        (4_688, 5.0, 3600.0),  # round(100,000 x 3/64 = 4,687.5)
        (1, 0.0, 86400.0),  # never fewer than one
    ]
    first = [a for a, _ in zip(jobs[0].requests(), range(50), strict=False)]
    assert first == [a for a, _ in zip(full[0].requests(), range(50), strict=False)]
    assert len(list(jobs[0].requests())) == 4_688
    # The second job's indices follow the first's sampled size, as they follow its full
    # size in the full run: every request id stays unique.
    assert next(iter(jobs[1].requests())).index == 4_688


def test_totals_scale_back_to_the_fleet_and_distributions_do_not() -> None:
    base = config()
    result = simulate(sampled(base, 2), base.policies[0])
    assert result.policy.pools[0].replicas == 4  # the fleet stood for, reported
    m = result.metrics
    assert {len(s.replicas) for s in m.samples} == {1} and m.samples[0].replicas == [2]
    summary = summarize(result, base.targets)
    assert summary["sampling"] == {"simulated_replicas": 2, "replicas": 4, "traffic_fraction": 0.5}
    assert summary["accelerator_hours"] == pytest.approx(2 * m.accelerator_s / 3600)
    assert m.accelerator_s == pytest.approx(2 * 8.0)  # two replicas simulated for 8 s
    for kind in (INTERACTIVE, BATCH):
        log, c = m.classes[kind], summary["classes"][kind]
        assert c["finished"] == 2 * log.num_finished
        assert c["output_tokens"] == 2 * log.output_tokens
        assert c["prompt_tokens"] == 2 * log.prompt_tokens
        assert c["unfinished_output_tokens"] == 2 * log.unfinished_output_tokens
        assert c["ttft_s"]["p99"] == percentile(list(log.ttft_s), 99)
        assert c["tpot_s"]["p50"] == percentile(list(log.tpot_s), 50)
    assert m.classes[INTERACTIVE].num_finished > 5
    own = m.classes[INTERACTIVE]
    assert summary["slo_attainment"] == own.num_met / (own.num_finished + own.num_refused)
    tokens = sum(
        c.prompt_tokens + c.output_tokens + c.unfinished_output_tokens for c in m.classes.values()
    )
    hours = m.accelerator_s / 3600
    assert summary["tokens_per_accelerator_hour"] == pytest.approx(tokens / hours)
    assert summary["timeline"]["replicas"][0] == [4]
    (job,) = summary["batch_jobs"]
    assert job["requests"] == 80 and job["done"] == 2 * result.jobs[0].num_done
    assert "sampled: 2 of 4 replicas simulated" in format_table([summary])


def test_sampling_a_separate_fleet_scales_each_pool() -> None:
    policy = config(policies=[{"name": "separate", "replicas": 8, "interactive_replicas": 2}])
    (fleet,) = policy.policies
    assert [p.replicas for p in Sampling(4, 8).policy(fleet).pools] == [1, 3]
    with pytest.raises(ConfigError, match=r"pool 'interactive': 2 replicas x 2/8 is not a whole"):
        sampled(policy, 2)


def test_a_bad_sample_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"sample_replicas.*must be >= 1, got 0"):
        config(sample_replicas=0)
    at_most = r"sample_replicas \(5\) must be at most the fleet's replicas \(4\)"
    with pytest.raises(ConfigError, match=at_most):
        config(sample_replicas=5)
    with pytest.raises(ConfigError, match=r"sample_replicas must be a whole number, got 'two'"):
        config(sample_replicas="two")
    with pytest.raises(ConfigError, match=r"pool 'priority' is autoscaled"):
        config(sample_replicas=2, autoscaler={"min_replicas": 1, "max_replicas": 8})
    assert config(sample_replicas=2).sample_replicas == 2
    with pytest.raises(ValueError, match="must be >= 1"):
        Sampling(-1, 4)


def test_the_cli_samples_with_dash_dash_sample_and_refuses_a_bad_k(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    path = tmp_path / "fleet.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "duration_s": 3.0,
                "replica": {"num_kv_blocks": 2000, "max_num_seqs": 32, "max_model_len": 4096},
                "interactive": {"peak_rate": 8.0, "daily_curve": [1.0]},
                "policies": [{"name": "priority", "replicas": 4}],
            }
        )
    )
    assert cli_main(["sim", str(path), "--sample", "9", "--quiet"]) == 2
    assert "sample_replicas (9) must be at most the fleet's replicas (4)" in capsys.readouterr().err
    assert cli_main(["sim", str(path), "--sample", "0", "--quiet"]) == 2
    assert "sample_replicas must be >= 1, got 0" in capsys.readouterr().err
    out = tmp_path / "out"
    assert cli_main(["sim", str(path), "--sample", "1", "--quiet", "--out", str(out)]) == 0
    assert "sampled: 1 of 4 replicas simulated" in capsys.readouterr().out
    (summary,) = json.loads((out / "sim.json").read_text())
    assert summary["sampling"]["simulated_replicas"] == 1
    assert summary["timeline"]["replicas"][0] == [4]
