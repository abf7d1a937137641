"""How fast the simulator runs: wall time for N replicas over a simulated span, engine
steps per second (planned by the real scheduler and leapt), and what a day of a fleet at
that load would take.

    .venv/bin/python bench/sim_scale.py --replicas 1000 --duration 86400 --rate 5
    .venv/bin/python bench/sim_scale.py --replicas 4 --duration 30 --rate 2 --batch 20000

`--rate` is interactive requests per second fleet-wide at the daily peak (the default
curve), `--batch` a batch job submitted at 0 (0: none). Llama-3-8B on H200, roofline
cost, priority policy. Writes sim_scale.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenfleet.sim.config import parse_config
from tokenfleet.sim.report import summarize
from tokenfleet.sim.run import simulate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=86400.0)
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--leap", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    data = {
        "duration_s": args.duration,
        "interactive": {"peak_rate": args.rate},
        "batch_jobs": [{"num_requests": args.batch}] if args.batch else [],
        "replica": {"leap": args.leap},
        "policies": [{"name": "priority", "replicas": args.replicas}],
        "sample_s": max(60.0, args.duration / 200),
    }
    config = parse_config(data)
    began = time.perf_counter()
    result = simulate(config, config.policies[0])
    wall = time.perf_counter() - began
    summary = summarize(result, config.targets)
    m = result.metrics
    steps = m.num_steps
    record = {
        "args": vars(args) | {"out": str(args.out)},
        "wall_s": wall,
        "engine_steps": steps,
        "steps_leapt": m.num_leap_steps,
        "steps_per_wall_s": steps / wall,
        "requests_finished": sum(c.num_finished for c in m.classes.values()),
        "wall_s_per_replica_day": wall / (args.replicas * args.duration / 86400),
        "interactive": summary["classes"]["interactive"],
        "batch": summary["classes"]["batch"],
    }
    print(
        f"{args.replicas} replicas x {args.duration:.0f} simulated s: {wall:.1f} s wall, "
        f"{steps:,} engine steps ({m.num_leap_steps:,} leapt), "
        f"{record['requests_finished']:,} requests finished; "
        f"{record['wall_s_per_replica_day']:.1f} s wall per replica-day at this load"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_scale.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
