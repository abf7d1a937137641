"""Sampled fleets (`sample_replicas: k`) against the full simulation, and what a simulated
day of a 1,000-replica fleet costs in wall time.

Workload, per replica, the stated demand of docs/simulator.md on the fleet its sizing
gives it (Llama-3-8B on H200: 100 interactive requests/s at the peak and 2 M batch
requests a day on 5 replicas, priority + harvest): 20 interactive requests/s at the peak
and 400,000 batch requests a day. A fleet of N replicas: N x 20 requests/s at the peak
(the default daily curve; the validation window starts at 12:00, in the peak hours) and
N x 400,000 batch requests as 100,000-request jobs in the backlog from the start, due in
24 h (so every replica has batch work beside its interactive traffic, as at the peak of a
day whose batch is not done). Roofline cost, harvest `tpot_target_s` 0.044, the sizing's
replica settings.

1. Validation: the full fleet of --replicas, then each --samples k (k replicas given k/N
   of the traffic), over --duration simulated seconds. Per run: tokens and output tokens
   per accelerator-hour, interactive TTFT p50/p99 and TPOT p50/p99, SLO attainment, and
   each sample's relative difference from the full run. Goal: tokens per accelerator-hour
   and TPOT p99 within 5 %.
2. Timing: simulated seconds per wall second per simulated replica, from every run above
   and from one replica over --rate-duration at a few points of the daily curve (night to
   peak); the day of --day-replicas then costs k x sum over the day's hours of 3,600 s x
   the wall time per simulated replica-second at that hour's load. It is run when that
   estimate is within --day-budget-s, otherwise reported as the figure and its arithmetic.

    .venv/bin/python bench/sim_sampled.py --duration 100 --rate-duration 60   # 45 min here
    .venv/bin/python bench/sim_sampled.py --timing-only                       # 2 min
    .venv/bin/python bench/sim_sampled.py                  # the goal's 10 min: ~2-4 h here
    .venv/bin/python bench/sim_sampled.py --samples 1,2,4 \
        --reuse bench/results/sim_sampled.json --out /tmp/more    # more k, the same full run

The full run and the samples can run in two processes, then be put together in seconds:

    .venv/bin/python bench/sim_sampled.py --samples "" --out /tmp/full &
    .venv/bin/python bench/sim_sampled.py --no-full --out /tmp/samples
    .venv/bin/python bench/sim_sampled.py --reuse /tmp/full/sim_sampled.json \
        --reuse /tmp/samples/sim_sampled.json
    .venv/bin/python bench/sim_sampled.py --replicas 8 --samples 2,4 --duration 20 \
        --rate-duration 20 --out /tmp/bench                               # smoke, ~1 min

Writes sim_sampled.json and sim_sampled.png into --out (sim_sampled_timing.* with
--timing-only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.log import log
from common.results import RunStart, args_json, fmt_ms, format_table, write_result

from tokenfleet.sim.config import SimConfig, parse_config, sampled
from tokenfleet.sim.report import summarize
from tokenfleet.sim.run import simulate
from tokenfleet.sim.workload import DAY_S, DEFAULT_DAILY_CURVE

RESULT_NAME = "sim_sampled"
JOB_REQUESTS = 100_000  # a batch job's most
GOAL = 0.05  # relative difference allowed on the goal's two figures
DAY_GOAL_S = 3600.0
# (key in a run's figures, label, whether the goal holds it within GOAL)
FIGURES = (
    ("tokens_per_accelerator_hour", "tok/acc-h", True),
    ("output_tokens_per_accelerator_hour", "out tok/acc-h", False),
    ("ttft_p50_s", "TTFT p50", False),
    ("ttft_p99_s", "TTFT p99", False),
    ("tpot_p50_s", "TPOT p50", False),
    ("tpot_p99_s", "TPOT p99", True),
    ("slo_attainment", "SLO", False),
)


def fleet_config(
    args: argparse.Namespace, replicas: int, duration_s: float, start_hour: float
) -> SimConfig:
    """N replicas at the per-replica demand (module doc), `duration_s` from `start_hour`."""
    batch = replicas * args.batch_per_replica_day
    jobs = [
        {"num_requests": min(JOB_REQUESTS, batch - first), "deadline_s": DAY_S}
        for first in range(0, batch, JOB_REQUESTS)
    ]
    return parse_config(
        {
            "seed": args.seed,
            "duration_s": duration_s,
            "model": "llama-3-8b",
            "interactive": {
                "peak_rate": replicas * args.peak_per_replica,
                "start_hour": start_hour,
                "lengths": {"max_prompt_len": 4000},
            },
            "batch_jobs": jobs,
            "replica": {"tpot_target_s": args.tpot_target},
            "policies": [{"name": "priority", "replicas": replicas}],
            "sample_s": duration_s / 20,
        }
    )


def run(config: SimConfig, label: str) -> dict[str, Any]:
    """One simulation, its progress logged; the figures compared and its speed."""
    policy = config.policies[0]
    sampling = config.sampling(policy)
    simulated = policy.pools[0].replicas if sampling is None else sampling.num_simulated
    duration = config.duration_s
    began, cpu_began = time.perf_counter(), time.process_time()
    shown = [0.0]

    def progress(now: float) -> None:
        if now - shown[0] >= duration / 5:
            shown[0] = now
            wall = time.perf_counter() - began
            log(f"  {label}: {now:.0f}/{duration:.0f} simulated s, {wall:.0f} s wall")

    result = simulate(config, policy, progress)
    cpu_s = time.process_time() - cpu_began
    s = summarize(result, config.targets)
    interactive = s["classes"]["interactive"]
    replica_s = simulated * duration
    found = {
        "run": label,
        "replicas": policy.pools[0].replicas,
        "simulated_replicas": simulated,
        "duration_s": duration,
        "tokens_per_accelerator_hour": s["tokens_per_accelerator_hour"],
        "output_tokens_per_accelerator_hour": s["output_tokens_per_accelerator_hour"],
        "ttft_p50_s": interactive["ttft_s"]["p50"],
        "ttft_p99_s": interactive["ttft_s"]["p99"],
        "tpot_p50_s": interactive["tpot_s"]["p50"],
        "tpot_p99_s": interactive["tpot_s"]["p99"],
        "slo_attainment": s["slo_attainment"],
        "interactive_finished": interactive["finished"],
        "interactive_finished_simulated": result.metrics.classes["interactive"].num_finished,
        "batch_finished": s["classes"]["batch"]["finished"],
        "accelerator_hours": s["accelerator_hours"],
        "engine_steps": s["engine_steps"],
        "steps_leapt": s["steps_leapt"],
        "wall_s": result.wall_s,
        "wall_s_per_replica_s": result.wall_s / replica_s,
        # This process's CPU time, set-up included: what the run cost on a shared machine.
        "cpu_s": cpu_s,
        "cpu_s_per_replica_s": cpu_s / replica_s,
        "simulated_s_per_wall_s_per_replica": replica_s / result.wall_s,
    }
    log(
        f"{label}: {result.wall_s:.0f} s wall, {found['wall_s_per_replica_s']:.3f} s wall "
        f"per simulated replica-second; tok/acc-h {found['tokens_per_accelerator_hour']:.3e}, "
        f"TPOT p99 {fmt_ms(found['tpot_p99_s'])} ms"
    )
    return found


def differences(full: dict[str, Any], sample: dict[str, Any]) -> dict[str, float | None]:
    """sample / full - 1 for each figure."""
    out: dict[str, float | None] = {}
    for key, _, _ in FIGURES:
        a, b = full[key], sample[key]
        out[key] = None if a is None or b is None or a == 0 else b / a - 1
    return out


def validation_table(runs: list[dict[str, Any]], diffs: dict[str, dict[str, Any]]) -> str:
    rows = [["run", *(label for _, label, _ in FIGURES), "wall s"]]
    for r in runs:
        cells = [
            f"{r[key]:.3e}" if "accelerator" in key else
            f"{r[key]:.1%}" if key == "slo_attainment" else fmt_ms(r[key])
            for key, _, _ in FIGURES
        ]  # fmt: skip
        rows.append([r["run"], *cells, f"{r['wall_s']:.0f}"])
        if r["run"] in diffs:
            d = diffs[r["run"]]
            rows.append(["  vs full", *(_pct(d[key]) for key, _, _ in FIGURES), ""])
    return format_table(rows)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def curve_rates(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One replica over --rate-duration at each of --curve-factors of the peak."""
    found = []
    for factor in args.curve_factors:
        # A curve of one factor: the whole run at that share of the peak.
        config = fleet_config(args, 1, args.rate_duration, 0.0)
        config = replace(config, interactive=replace(config.interactive, daily_curve=(factor,)))
        r = run(config, f"1 replica at {factor:g} x peak")
        found.append({"curve_factor": factor, **r})
    return found


def wall_per_replica_s_at(rates: list[dict[str, Any]], factor: float) -> float:
    """Wall s per simulated replica-second at `factor` of the peak, linear between the
    factors measured (flat beyond them)."""
    points = sorted((r["curve_factor"], r["wall_s_per_replica_s"]) for r in rates)
    if factor <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if factor <= x1:
            return y0 + (y1 - y0) * (factor - x0) / (x1 - x0)
    return points[-1][1]


def day_estimate(args: argparse.Namespace, rates: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Wall s for a day of --day-replicas run as k replicas: k x sum over the curve's
    hours of 3,600 s x the wall time per replica-second at that hour's load."""
    hourly = [wall_per_replica_s_at(rates, f) for f in DEFAULT_DAILY_CURVE]
    per_replica_day = sum(3600 * c for c in hourly)
    return {
        "simulated_replicas": k,
        "replicas": args.day_replicas,
        "wall_s_per_replica_day": per_replica_day,
        "wall_s": k * per_replica_day,
        "arithmetic": f"{k} x sum_h 3600 s x c(h) = {k} x {per_replica_day:,.0f} s "
        f"= {k * per_replica_day:,.0f} s ({k * per_replica_day / 3600:.1f} h); c(h) from "
        f"{min(hourly):.3f} to {max(hourly):.3f} s wall per simulated replica-second",
    }


def plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (diff_ax, day_ax) = plt.subplots(1, 2, figsize=(13, 5))
    if result["validation"] is None:
        diff_ax.set_axis_off()
    else:
        _plot_differences(diff_ax, result)
    days = result["day"]["estimates"]
    ks = [d["simulated_replicas"] for d in days]
    day_ax.bar([str(k) for k in ks], [d["wall_s"] / 3600 for d in days], color="tab:blue")
    day_ax.axhline(DAY_GOAL_S / 3600, color="tab:red", linestyle="--", label="goal: 1 h")
    day_ax.set_yscale("log")
    day_ax.set_xlabel(f"replicas simulated of {result['day']['replicas']:,}")
    day_ax.set_ylabel("wall hours for the simulated day")
    day_ax.set_title("a day of the fleet: wall time by sample size")
    day_ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_differences(diff_ax: Any, result: dict[str, Any]) -> None:
    labels = [label for _, label, _ in FIGURES]
    samples = list(result["differences"])
    width = 0.8 / max(len(samples), 1)
    for i, name in enumerate(samples):
        values = [100 * (result["differences"][name][key] or 0.0) for key, _, _ in FIGURES]
        xs = [j + (i - (len(samples) - 1) / 2) * width for j in range(len(FIGURES))]
        diff_ax.bar(xs, values, width, label=name)
    diff_ax.axhspan(-100 * GOAL, 100 * GOAL, color="tab:green", alpha=0.1, label="goal: +-5 %")
    diff_ax.axhline(0, color="black", linewidth=0.5)
    diff_ax.set_xticks(range(len(FIGURES)), labels, rotation=30, ha="right")
    diff_ax.set_ylabel("sampled vs full (%)")
    v = result["validation"]
    diff_ax.set_title(f"{v['replicas']} replicas, {v['duration_s']:.0f} simulated s at the peak")
    diff_ax.legend(fontsize="small")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--replicas", type=int, default=64, help="the full fleet validated against")
    add("--samples", default="8,16", help="sample sizes k, comma-separated")
    add("--duration", type=float, default=600.0, help="simulated s of the peak a run")
    add("--peak-per-replica", type=float, default=20.0, help="interactive req/s at the peak")
    add("--batch-per-replica-day", type=int, default=400_000, help="batch requests")
    add("--tpot-target", type=float, default=0.044, help="the harvest's tpot_target_s")
    add("--rate-duration", type=float, default=300.0, help="simulated s a timing run")
    add("--timing-only", action="store_true", help="no validation: the timing and the day")
    add("--curve-factors", default="0.18,0.6,1.0", help="loads timed, shares of the peak")
    add("--day-replicas", type=int, default=1000)
    add("--day-sample", type=int, default=8, help="k for the day when it is run")
    add("--day-budget-s", type=float, default=1500.0, help="run the day if it fits this")
    add("--seed", type=int, default=0)
    add(
        "--reuse",
        type=Path,
        action="append",
        default=[],
        help="an earlier result whose validation runs are taken, not run again (repeatable)",
    )
    add(
        "--no-full",
        action="store_true",
        help="the samples only (beside a full run in another process; then --reuse both)",
    )
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    args.samples = [int(k) for k in args.samples.split(",") if k]
    args.curve_factors = [float(f) for f in args.curve_factors.split(",") if f]
    args.num_threads = 1  # the simulator is one Python thread
    if any(not 1 <= k <= args.replicas for k in args.samples):
        parser.error(f"--samples must each be in 1..{args.replicas}")
    return args


def reused_runs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Validation runs of earlier results (--reuse), by label ("full 64", "sample 8/64"):
    taken instead of simulating the same run again. Each result's replicas, duration,
    workload and seed must be this run's."""
    found: dict[str, dict[str, Any]] = {}
    same = ("replicas", "duration", "peak_per_replica", "batch_per_replica_day", "tpot_target")
    for path in args.reuse:
        earlier = json.loads(path.read_text())
        differ = [k for k in (*same, "seed") if earlier["args"][k] != getattr(args, k)]
        if differ:
            sys.exit(f"--reuse {path}: another run ({', '.join(differ)} differ)")
        for r in (earlier.get("validation") or {}).get("runs", []):
            found[r["run"]] = r
    return found


def reuse_or_run(
    reused: dict[str, dict[str, Any]], config: SimConfig, label: str
) -> dict[str, Any]:
    if label in reused:
        log(f"{label}: reused ({reused[label]['wall_s']:.0f} s wall then)")
        return reused[label]
    return run(config, label)


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """The full fleet, then each sample, compared (part 1 of the module doc)."""
    full_config = fleet_config(args, args.replicas, args.duration, 12.0)
    full = "no full run" if args.no_full else f"{args.replicas} replicas in full"
    log(f"validation: {full}, samples {args.samples}")
    reused = reused_runs(args)
    runs = [] if args.no_full else [reuse_or_run(reused, full_config, f"full {args.replicas}")]
    for k in args.samples:
        label = f"sample {k}/{args.replicas}"
        runs.append(reuse_or_run(reused, sampled(full_config, k), label))
    diffs = {} if args.no_full else {r["run"]: differences(runs[0], r) for r in runs[1:]}
    goal = {
        name: all(d[key] is not None and abs(d[key]) <= GOAL for key, _, held in FIGURES if held)
        for name, d in diffs.items()
    }
    print(validation_table(runs, diffs))
    for name, met in goal.items():
        print(f"goal (tok/acc-h and TPOT p99 within 5 %), {name}: {'met' if met else 'not met'}")
    return {
        "validation": {
            "replicas": args.replicas,
            "duration_s": args.duration,
            "start_hour": 12.0,
            "runs": runs,
        },
        "differences": diffs,
        "goal_met": goal,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = RunStart.now()
    validation = None if args.timing_only else validate(args)
    log(f"timing: one replica at {args.curve_factors} of the peak")
    rates = curve_rates(args)
    ks = sorted({1, *args.samples, args.day_sample, args.day_replicas})
    estimates = [day_estimate(args, rates, k) for k in ks]
    for e in estimates:
        print(f"day of {args.day_replicas:,} replicas as {e['simulated_replicas']}: "
              f"{e['arithmetic']}")  # fmt: skip
    planned = day_estimate(args, rates, args.day_sample)
    day_run = None
    if planned["wall_s"] <= args.day_budget_s:
        log(f"the day as {args.day_sample} replicas fits: running it")
        day_config = sampled(fleet_config(args, args.day_replicas, DAY_S, 0.0), args.day_sample)
        day_run = run(day_config, f"day {args.day_sample}/{args.day_replicas}")
    else:
        print(
            f"the day as {args.day_sample} replicas (est. {planned['wall_s']:,.0f} s) is over "
            f"--day-budget-s {args.day_budget_s:,.0f}: not run; the figure is the estimate"
        )
    fits = [e["simulated_replicas"] for e in estimates if e["wall_s"] <= DAY_GOAL_S]
    result = {
        "workload": {
            "model": "llama-3-8b",
            "accelerator": "H200",
            "policy": "priority",
            "peak_per_replica": args.peak_per_replica,
            "batch_per_replica_day": args.batch_per_replica_day,
            "tpot_target_s": args.tpot_target,
        },
        "validation": validation and validation["validation"],
        "differences": validation and validation["differences"],
        "goal_met": validation and validation["goal_met"],
        "timing": {"curve": rates},
        "day": {
            "replicas": args.day_replicas,
            "estimates": estimates,
            "run": day_run,
            "goal_s": DAY_GOAL_S,
            "samples_within_goal": fits,
            "smallest_sample_wall_s": estimates[0]["wall_s"],
        },
    }
    out = start.provenance(args) | {"args": args_json(args), **result}
    name = RESULT_NAME + ("_timing" if args.timing_only else "")
    write_result(args.out, name, out, lambda path: plot(path, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
