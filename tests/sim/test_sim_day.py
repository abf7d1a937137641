"""A day of the fleet: the daily curve compressed into fewer simulated seconds
(`interactive.hour_s`, batch jobs' times compressed with it, bad values refused), and what
the samples record for a day's report (replicas starting and draining, interactive
requests arrived, finished and within targets, batch tokens done per job)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from test_sim import small_config

from tokenfleet.sim.config import ConfigError
from tokenfleet.sim.report import format_table, summarize
from tokenfleet.sim.run import interactive_stream, job_submissions, simulate
from tokenfleet.sim.workload import (
    BatchJob,
    InteractiveWorkload,
    batch_requests,
    daily_volume,
    interactive_arrivals,
)

CURVE = tuple(h / 32 for h in range(24))  # a different factor every hour

# -- the compressed day ------------------------------------------------------------------


def test_a_curve_hour_lasts_hour_s_simulated_seconds() -> None:
    workload = InteractiveWorkload(peak_rate=10.0, daily_curve=CURVE, hour_s=60.0)
    assert workload.compression == 60.0
    assert workload.rate_at(0.0) == 10.0 * CURVE[0]
    assert workload.rate_at(59.999) == 10.0 * CURVE[0]
    assert workload.rate_at(60.0) == 10.0 * CURVE[1]
    assert workload.rate_at(23 * 60.0 + 1) == 10.0 * CURVE[23]
    assert workload.rate_at(24 * 60.0) == 10.0 * CURVE[0]  # the next day
    noon = InteractiveWorkload(peak_rate=10.0, daily_curve=CURVE, hour_s=60.0, start_hour=12)
    assert noon.rate_at(0.0) == 10.0 * CURVE[12]
    assert noon.rate_at(12 * 60.0) == 10.0 * CURVE[0]
    real = InteractiveWorkload(peak_rate=10.0, daily_curve=CURVE)
    assert real.compression == 1.0
    assert real.rate_at(3599.0) == 10.0 * CURVE[0]
    assert real.rate_at(3600.0) == 10.0 * CURVE[1]
    assert daily_volume(workload) == 10.0 * sum(CURVE) * 60.0
    assert daily_volume(real) == 10.0 * sum(CURVE) * 3600.0


def test_arrivals_follow_the_compressed_curve() -> None:
    curve = tuple([1.0] * 12 + [0.25] * 12)
    workload = InteractiveWorkload(peak_rate=20.0, daily_curve=curve, hour_s=36.0)
    arrivals = list(interactive_arrivals(workload, 24 * 36.0, seed=0))
    day = sum(a.arrival_s < 12 * 36.0 for a in arrivals)
    night = len(arrivals) - day
    # Poisson counts: 8,640 and 2,160 expected, within 5 standard deviations.
    assert abs(day - 8640) < 5 * math.sqrt(8640)
    assert abs(night - 2160) < 5 * math.sqrt(2160)
    assert max(a.arrival_s for a in arrivals) < 24 * 36.0


def test_batch_jobs_are_put_on_the_compressed_clock() -> None:
    job = {"num_requests": 10, "submit_s": 6 * 3600.0, "deadline_s": 86400.0}
    config = small_config(interactive={"peak_rate": 1.0, "hour_s": 150.0}, batch_jobs=[job])
    assert config.interactive.hour_s == 150.0
    assert (config.batch_jobs[0].submit_s, config.batch_jobs[0].deadline_s) == (900.0, 3600.0)
    submission = job_submissions(config)[0]
    assert (submission.submit_s, submission.deadline_s) == (900.0, 3600.0)
    real = small_config(batch_jobs=[job])
    assert (real.batch_jobs[0].submit_s, real.batch_jobs[0].deadline_s) == (21600.0, 86400.0)
    same = BatchJob(submit_s=5.0, deadline_s=7.0)
    assert same.on_clock_of(InteractiveWorkload()) is same


@pytest.mark.parametrize("bad", [0, -60.0, 3601.0, math.inf, math.nan, "60", True, None])
def test_a_bad_hour_s_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^interactive: hour_s \(simulated seconds an hour of the daily curve lasts\) "
        r"must be a number in \(0, 3600\], got ",
    ):
        small_config(interactive={"hour_s": bad})


# -- what a day's samples record --------------------------------------------------------


def test_samples_count_draining_replicas_until_they_retire() -> None:
    """Three replicas, batch only, a calm window drains one each 5 s once the batch rate is
    measured (from the second window: `batch_settle_s` 0): both drained replicas hold
    batch requests (draining from 10 and 15 s, counted in `replicas` until they retire,
    by 25 and by 40 s)."""
    lengths = {"output_median": 600, "max_model_len": 4096}
    config = small_config(
        duration_s=50.0,
        interactive={"peak_rate": 0.0},
        batch_jobs=[{"num_requests": 300, "lengths": lengths}],
        autoscaler={
            "min_replicas": 1,
            "max_replicas": 3,
            "window_s": 5.0,
            "down_windows": 1,
            "down_cooldown_s": 0.0,
            "batch_settle_s": 0.0,
        },
        policies=[{"name": "priority", "replicas": 3}],
    )
    result = simulate(config, config.policies[0])
    samples = result.metrics.samples
    assert [s.time_s for s in samples] == [5.0 * i for i in range(10)]
    assert [s.replicas for s in samples] == [[3]] * 5 + [[2]] * 3 + [[1]] * 2
    draining = [[0], [0], [1], [2], [2], [1], [1], [1], [0], [0]]
    assert [s.draining for s in samples] == draining
    assert [s.starting for s in samples] == [[0]] * 10
    # Batch output tokens of the job's finished requests; all 300 are done by 45 s.
    (job,) = result.jobs
    assert job.num_done == 300 and job.last_done_at is not None and 40 < job.last_done_at < 45
    total = sum(a.output_len for a in batch_requests(config.batch_jobs[0], 0, 0, config.seed))
    tokens = [s.batch_output_tokens[0] for s in samples]
    assert tokens[0] == 0 and tokens[:9] == sorted(set(tokens[:9])) and tokens[8] < total
    assert tokens[9] == total
    summary = summarize(result, config.targets)
    assert summary["timeline"]["draining"] == draining
    assert summary["timeline"]["batch_output_tokens"][-1] == {"0": total}
    assert summary["autoscaler"] == {
        "priority": {
            "windows": 9,
            "by_reason": {"calm": 2, "hold": 7},
            "scale_ups": 0,
            "scale_downs": 2,
            "replicas_added": 0,
            "replicas_removed": 2,
        }
    }
    assert (
        "autoscaler priority: 9 windows (calm 2, hold 7); 0 replicas asked for, 2 drained"
        in format_table([summary])
    )


def test_samples_count_interactive_requests_arrived_finished_and_within_targets() -> None:
    config = small_config(duration_s=30.0)
    result = simulate(config, config.policies[0])
    samples = result.metrics.samples
    times = [a.arrival_s for a in interactive_stream(config)]
    # Arrivals at or before the sample (an arrival at the sample's time is handled first).
    assert [s.interactive_arrived for s in samples] == [
        sum(t <= s.time_s for t in times) for s in samples
    ]
    assert samples[-1].interactive_arrived == 24  # not vacuous: the seed's arrivals by 25 s
    finished = [s.interactive_finished for s in samples]
    assert finished == sorted(finished) and finished[0] == 0
    assert 0 < finished[-1] <= result.metrics.classes["interactive"].num_finished
    assert all(s.interactive_met <= s.interactive_finished for s in samples)
    assert [s.interactive_refused for s in samples] == [0] * len(samples)
