"""Sizing: how many accelerators each fleet policy needs for a stated load, from short
simulated windows on two replicas (the router balances load, so a replica's capacity is
taken to carry over to a fleet of any size; stated as an assumption, not measured here).

Per deployment (Llama-3-8B on H200; Llama-3-70B on H200 with TP 4), measured:

* interactive capacity: the highest peak rate per replica (binary search) whose
  interactive TTFT p50/p99 and TPOT p50/p99 meet the targets, interactive traffic alone;
* batch throughput: output tokens per second of a replica saturated by batch alone;
* priority capacity: the same search with a saturating batch job beside it (harvest
  budget), and the batch tokens/s the replica harvests at that rate;
* fcfs: whether the targets hold with batch beside interactive at the lowest rate tried.

Then for the stated demand (peak interactive rate, daily batch requests):
separate = ceil(peak / interactive capacity) + ceil(daily batch tokens / (batch tokens/s
x 86400)); priority = enough replicas for the peak at the priority capacity and for the
daily batch at the harvested rate (taken at peak load: a lower bound over the day).

    .venv/bin/python bench/sim_sizing.py --out bench-out      # ~10 min per deployment
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tokenfleet.sim.config import parse_config
from tokenfleet.sim.report import summarize
from tokenfleet.sim.run import simulate

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
        "batch_tokens_per_replica_s": s["classes"]["batch"]["output_tokens"] / duration / REPLICAS,
    }


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


def size(name: str, deployment: dict[str, Any], duration: float) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    interactive = capacity(deployment, "priority", False, duration, runs)
    batch_only = run(deployment, "priority", 0.0, True, duration)
    priority = capacity(deployment, "priority", True, duration, runs)
    fcfs = run(deployment, "fcfs", 0.25, True, duration)
    runs += [{"policy": "batch alone", **batch_only}, {"policy": "fcfs", **fcfs}]
    tp = deployment["tensor_parallel"]
    daily_tokens = deployment["daily_batch"] * 256  # the output median, as configured
    sizes: dict[str, Any] = {}
    if interactive:
        sizes["separate"] = tp * (
            math.ceil(deployment["peak"] / interactive["rate_per_replica"])
            + math.ceil(daily_tokens / (batch_only["batch_tokens_per_replica_s"] * 86400))
        )
    if priority and priority["batch_tokens_per_replica_s"] > 0:
        sizes["priority"] = tp * max(
            math.ceil(deployment["peak"] / priority["rate_per_replica"]),
            math.ceil(daily_tokens / (priority["batch_tokens_per_replica_s"] * 86400)),
        )
    sizes["fcfs"] = "not met at 0.25/s/replica" if not fcfs["met"] else "met at 0.25/s/replica"
    return {
        "deployment": name,
        **deployment,
        "window_s": duration,
        "accelerators": sizes,
        "interactive_capacity": interactive,
        "batch_alone": batch_only,
        "priority_capacity": priority,
        "fcfs": fcfs,
        "runs": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="simulated s a run")
    parser.add_argument("--only", help="one deployment name")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, deployment in DEPLOYMENTS.items():
        if args.only and args.only != name:
            continue
        print(name, flush=True)
        began = time.perf_counter()
        results.append(
            size(name, deployment, args.duration) | {"wall_s": time.perf_counter() - began}
        )
        print(json.dumps(results[-1]["accelerators"]), flush=True)
        (args.out / "sim_sizing.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
