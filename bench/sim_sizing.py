"""Sizing: how many accelerators each fleet policy needs for a stated load, from short
simulated windows on two replicas (the router balances load, so a replica's capacity is
taken to carry over to a fleet of any size; stated as an assumption, not measured here).

Per deployment (Llama-3-8B on H200; Llama-3-70B on H200 with TP 4), measured:

* interactive capacity: the highest peak rate per replica (binary search) whose
  interactive TTFT p50/p99 and TPOT p50/p99 meet the targets, interactive traffic alone;
* batch throughput: output tokens per second of a replica saturated by batch alone;
* priority capacity: the same search with a saturating batch job beside it (harvest
  budget), and the batch tokens/s the replica harvests at that rate;
* fcfs capacity: the same search under the engine's fcfs policy with the batch job.

Then for the stated demand (peak interactive rate following the default daily curve,
daily batch requests at the batch job's mean output length, ~421 tokens):

    separate  = ceil(peak / interactive capacity)
                + ceil(daily batch tokens / (batch-alone tokens/s x 86400))
    one pool  = the fewest replicas that carry the peak within the policy's capacity and
                whose batch tokens over the day, hour by hour at that hour's interactive
                rate per replica (interpolated between the rates measured, batch alone
                at 0), reach the daily volume (priority, fcfs)

    .venv/bin/python bench/sim_sizing.py --out bench-out      # ~10 min per deployment
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tokenfleet.sim.config import parse_config
from tokenfleet.sim.report import summarize
from tokenfleet.sim.run import simulate
from tokenfleet.sim.workload import DEFAULT_DAILY_CURVE, BatchJob

DEPLOYMENTS = {
    "llama-3-8b / H200": {"model": "llama-3-8b", "tensor_parallel": 1, "peak": 100.0,
                          "daily_batch": 2_000_000},
    "llama-3-70b / H200 TP4": {"model": "llama-3-70b", "tensor_parallel": 4, "peak": 20.0,
                               "daily_batch": 200_000},
}  # fmt: skip
REPLICAS = 2
BATCH = 100_000  # saturating


def run(
    deployment: dict[str, Any], policy: str, rate: float, batch: bool, duration: float
) -> dict[str, Any]:
    config = parse_config(
        {
            "duration_s": duration,
            "model": deployment["model"],
            "tensor_parallel": deployment["tensor_parallel"],
            "interactive": {
                "peak_rate": rate * REPLICAS,
                "daily_curve": [1.0],
                "lengths": {"max_prompt_len": 4000},
            },
            "batch_jobs": [{"num_requests": BATCH}] if batch else [],
            "policies": [{"name": policy, "replicas": REPLICAS}],
            "replica": {"tpot_target_s": deployment["tpot_target_s"]},
            "sample_s": duration,
        }
    )
    s = summarize(simulate(config, config.policies[0]), config.targets)
    return {
        "rate_per_replica": rate,
        "met": s["targets_met"],
        "interactive": {
            k: s["classes"]["interactive"][k] for k in ("ttft_s", "tpot_s", "finished")
        },
        "batch_tokens_per_replica_s": batch_tokens(s["classes"]["batch"]) / duration / REPLICAS,
    }


def batch_tokens(summary: dict[str, Any]) -> int:
    """Output tokens batch made in the window, finished requests or not (a 60 s window
    ends most long outputs unfinished)."""
    return int(summary["output_tokens"] + summary["unfinished_output_tokens"])


def capacity(
    deployment: dict[str, Any],
    policy: str,
    batch: bool,
    duration: float,
    runs: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """The best run meeting the targets over a binary search of the rate (log scale)."""
    low, high, best = 0.25, 32.0, None
    for _ in range(6):
        rate = math.sqrt(low * high)
        result = run(deployment, policy, rate, batch, duration)
        runs.append({"policy": policy, "batch": batch, **result})
        print(
            f"  {policy:<9} batch={batch!s:<5} {rate:6.2f}/s/replica met={result['met']}",
            flush=True,
        )
        if result["met"]:
            low, best = rate, result
        else:
            high = rate
    return best


def mean_output_tokens(samples: int = 100_000) -> float:
    """The mean output length of the batch job's requests (the lognormal's mean, well
    above its 256-token median), from the job's own length distribution."""
    rng = random.Random(0)
    lengths = BatchJob().lengths
    return statistics.fmean(lengths.draw(rng)[1] for _ in range(samples))


def harvest(runs: list[dict[str, Any]], policy: str, alone: float) -> list[tuple[float, float]]:
    """(interactive rate per replica, batch tokens/s per replica) measured for `policy`
    with the batch job, rate 0 being batch alone; sorted by rate."""
    points = {0.0: alone}
    for r in runs:
        if r["policy"] == policy and r["batch"]:
            points[r["rate_per_replica"]] = r["batch_tokens_per_replica_s"]
    return sorted(points.items())


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def one_pool(
    peak: float, capacity: float, points: list[tuple[float, float]], daily_tokens: float
) -> int:
    """Fewest replicas carrying the peak and the day's batch (see the module doc)."""
    n = math.ceil(peak / capacity)
    while n < 100_000:
        made = sum(
            3600 * n * interpolate(points, peak * factor / n) for factor in DEFAULT_DAILY_CURVE
        )
        if made >= daily_tokens:
            return n
        n += 1
    raise ValueError("no fleet size carries the batch")


def size(name: str, deployment: dict[str, Any], duration: float) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    interactive = capacity(deployment, "priority", False, duration, runs)
    batch_only = run(deployment, "priority", 0.0, True, duration)
    runs.append({"policy": "batch alone", "batch": True, **batch_only})
    one = {p: capacity(deployment, p, True, duration, runs) for p in ("priority", "fcfs")}
    result = {
        "deployment": name,
        **deployment,
        "window_s": duration,
        "interactive_capacity": interactive,
        "batch_alone": batch_only,
        "one_pool_capacity": one,
        "runs": runs,
    }
    return result | {"accelerators": compose(result)}


def compose(result: dict[str, Any]) -> dict[str, Any]:
    """Accelerator counts from a result's measured runs (size() without running)."""
    runs = result["runs"]
    tp, peak = result["tensor_parallel"], result["peak"]
    daily_tokens = result["daily_batch"] * mean_output_tokens()
    alone = result["batch_alone"]["batch_tokens_per_replica_s"]
    sizes: dict[str, Any] = {}
    if result["interactive_capacity"]:
        sizes["separate"] = tp * (
            math.ceil(peak / result["interactive_capacity"]["rate_per_replica"])
            + math.ceil(daily_tokens / (alone * 86400))
        )
    for policy, best in result["one_pool_capacity"].items():
        if best is None:
            sizes[policy] = "targets not met at 0.25/s per replica or more"
            continue
        points = [p for p in harvest(runs, policy, alone) if p[0] <= best["rate_per_replica"]]
        sizes[policy] = tp * one_pool(peak, best["rate_per_replica"], points, daily_tokens)
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="simulated s a run")
    parser.add_argument("--only", help="one deployment name")
    parser.add_argument("--tpot-target", type=float, default=0.06, help="the harvest's")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, deployment in DEPLOYMENTS.items():
        if args.only and args.only != name:
            continue
        print(name, flush=True)
        began = time.perf_counter()
        deployment = {**deployment, "tpot_target_s": args.tpot_target}
        result = size(name, deployment, args.duration)
        results.append(result | {"wall_s": time.perf_counter() - began})
        print(json.dumps(results[-1]["accelerators"]), flush=True)
        (args.out / "sim_sizing.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
