"""The fleet's own autoscaler over a simulated day, compressed 60x: replicas over time
against the interactive load, SLO attainment hour by hour and over the day, each batch job
done against its deadline, the autoscaler's decisions by reason, accelerator-hours.

The day is **compressed**: a real day of a 3-replica fleet is hours of wall here (a
saturated replica costs ~0.1 s of CPU per simulated second, and the machine is shared), so
each hour of the default daily curve lasts --hour-s simulated seconds (60: the day in 24
simulated minutes, 60x). The curve, the batch jobs' times, deadlines and sizes are
compressed with it; requests are not (an interactive request still takes its ~15 s, a
replica drains what it holds). The autoscaler's start-up and cool-downs are divided by the
compression (real 120 s / 60 s / 300 s -> 2 s / 1 s / 5 s), so they keep their place
against the curve; its window is 2 s (60 s / 30, not / 60: a 1 s window would hold ~11
interactive requests at night, and one miss in it would read as attainment under
slo_low). So against a real day: the autoscaler acts on the same curve hours, a window
measures 30x fewer requests, and a request lasts 60x longer in curve time (a job's last
long requests hold it open for curve hours; a draining replica drains for as long).

Workload (docs/simulator.md's sizing demand per replica, on 3 replicas at the peak):
Llama-3-8B on H200, roofline cost, harvest tpot_target_s 0.044; interactive 60 requests/s
at the peak on the default daily curve (prompts ~1,024 tokens, outputs ~256 with a long
tail, 80 % sharing one of 8 system prompts); 4 batch jobs, each a 300,000-request job of a
real day (1.2 M a day in all; 5,000 requests each at 60x), submitted at 00:00, 06:00,
12:00 and 16:00 and due 8 curve hours later. Policies, every pool autoscaled (min 1, max
--max-replicas) from one replica: `priority` (one pool, priority + harvest) and `separate`
(an interactive pool and a batch pool).

    nice -n 10 .venv/bin/python bench/sim_autoscale_day.py     # 25 min here (1,518 s)
    nice -n 10 .venv/bin/python bench/sim_autoscale_day.py --hour-s 10 \
        --out /tmp/bench                                       # smoke, a few minutes
    .venv/bin/python bench/sim_autoscale_day.py --replot       # table and PNG from the JSON

The policies run side by side, one process each (2026-12-04: 1,517 s and 1,464 s of wall
each, the 2 cores shared with other work at a load of 4 to 20). Writes
sim_autoscale_day.json and sim_autoscale_day.png into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from common.log import log
from common.results import RunStart, args_json, format_table, write_result

from tokenfleet.sim.config import SimConfig, parse_config
from tokenfleet.sim.report import summarize
from tokenfleet.sim.run import simulate
from tokenfleet.sim.workload import DAY_S

RESULT_NAME = "sim_autoscale_day"
HOUR_S = DAY_S / 24
SAMPLES_PER_HOUR = 24
PHASES = ("serving", "draining", "starting")  # replicas, as the timeline counts them
POLICY_COLORS = {"priority": "tab:blue", "separate": "tab:orange"}


def job_requests(args: argparse.Namespace) -> int:
    """A job's requests in the compressed day: the real day's job, compressed."""
    return max(1, round(args.job_requests_real_day * args.hour_s / HOUR_S))


def fleet_config(args: argparse.Namespace, policy: str) -> SimConfig:
    """The day for one policy (module doc); every pool autoscaled from one replica."""
    compression = HOUR_S / args.hour_s
    pools = (
        {"name": "separate", "replicas": 2, "interactive_replicas": 1}
        if policy == "separate"
        else {"name": policy, "replicas": 1}
    )
    return parse_config(
        {
            "seed": args.seed,
            "duration_s": 24 * args.hour_s,
            "model": "llama-3-8b",
            "accelerator": "H200",
            "interactive": {
                "peak_rate": args.peak_rate,
                "hour_s": args.hour_s,
                "lengths": {"max_prompt_len": 4000},
            },
            # On the real day's clock: the config compresses them with the curve.
            "batch_jobs": [
                {
                    "submit_s": hour * HOUR_S,
                    "deadline_s": args.deadline_h * HOUR_S,
                    "num_requests": job_requests(args),
                }
                for hour in args.job_hours
            ],
            "replica": {"tpot_target_s": args.tpot_target},
            "policies": [pools],
            "autoscaler": {
                "min_replicas": 1,
                "max_replicas": args.max_replicas,
                "window_s": args.window_s,
                "startup_s": args.startup_s / compression,
                "up_cooldown_s": args.up_cooldown_s / compression,
                "down_cooldown_s": args.down_cooldown_s / compression,
            },
            "sample_s": args.hour_s / SAMPLES_PER_HOUR,
        }
    )


def run(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    config = fleet_config(args, policy)
    duration = config.duration_s
    began = time.perf_counter()
    shown = [0.0]

    def progress(now: float) -> None:
        if now - shown[0] >= 2 * args.hour_s:
            shown[0] = now
            wall = time.perf_counter() - began
            log(f"  {policy}: curve hour {now / args.hour_s:.0f}/24, {wall:.0f} s wall")

    log(f"{policy}: {duration:.0f} simulated s (a day of the curve)")
    result = simulate(config, config.policies[0], progress)
    summary = summarize(result, config.targets)
    log(f"{policy}: done, {result.wall_s:.0f} s wall")
    return analyse(args, config, summary)


def analyse(args: argparse.Namespace, config: SimConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """The day hour by hour, the jobs against their deadlines, the decisions."""
    timeline = summary["timeline"]
    times = timeline["time_s"]
    hour_s = args.hour_s
    pools = [p["name"] for p in summary["pools"]]
    serving = [
        [n - d for n, d in zip(r, dr, strict=True)]
        for r, dr in zip(timeline["replicas"], timeline["draining"], strict=True)
    ]
    at = {round(t / hour_s * SAMPLES_PER_HOUR): i for i, t in enumerate(times)}
    hours = []
    for hour in range(24):
        first, last = at.get(hour * SAMPLES_PER_HOUR), at.get((hour + 1) * SAMPLES_PER_HOUR)
        inside = [i for i, t in enumerate(times) if hour * hour_s <= t < (hour + 1) * hour_s]
        if first is None or not inside:
            break
        end = last if last is not None else len(times) - 1

        def delta(key: str, first: int = first, end: int = end) -> int:
            return int(timeline[key][end] - timeline[key][first])

        judged = delta("interactive_finished") + delta("interactive_refused")
        hours.append(
            {
                "hour": hour,
                "curve_rate": config.interactive.rate_at(hour * hour_s),
                "arrival_rate": delta("interactive_arrived") / ((times[end] - times[first]) or 1),
                "serving_mean": [
                    sum(serving[i][p] for i in inside) / len(inside) for p in range(len(pools))
                ],
                "serving_max": [max(serving[i][p] for i in inside) for p in range(len(pools))],
                "finished": delta("interactive_finished"),
                "slo_attainment": delta("interactive_met") / judged if judged else None,
            }
        )
    jobs = []
    for spec, job in zip(config.batch_jobs, summary["batch_jobs"], strict=True):
        done = job["done"] == job["requests"]
        jobs.append(
            {
                **job,
                "submit_s": spec.submit_s,
                "submit_hour": spec.submit_s / hour_s,
                "deadline_hour": job["deadline_at_s"] / hour_s,
                "completed_hour": job["last_done_at_s"] / hour_s if done else None,
                "met": done and job["done_by_deadline"] == job["requests"],
            }
        )
    accelerator_hours = summary["accelerator_hours"]
    peak = max((sum(s) for s in serving), default=0)
    return {
        "policy": summary["policy"],
        "pools": pools,
        "slo_attainment": summary["slo_attainment"],
        "targets_met": summary["targets_met"],
        "interactive": summary["classes"]["interactive"],
        "batch": summary["classes"]["batch"],
        "hours": hours,
        "jobs": jobs,
        "all_jobs_met": all(j["met"] for j in jobs),
        "autoscaler": summary["autoscaler"],
        "accelerator_hours": accelerator_hours,
        # A real day's worth: the compressed day's replica-time stretched back out.
        "accelerator_hours_real_day": accelerator_hours * HOUR_S / hour_s,
        "peak_serving": peak,
        "fixed_at_peak_accelerator_hours_real_day": peak * 24.0,
        "timeline": {
            "time_s": times,
            "serving": serving,
            "starting": timeline["starting"],
            "draining": timeline["draining"],
            "interactive_arrived": timeline["interactive_arrived"],
            "batch_output_tokens": timeline["batch_output_tokens"],
        },
        "engine_steps": summary["engine_steps"],
        "steps_leapt": summary["steps_leapt"],
        "wall_s": summary["wall_s"],
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def mean_replicas(run: dict[str, Any]) -> dict[str, float]:
    """Serving, draining and starting replicas over the day's samples, all pools."""
    t = run["timeline"]
    return {key: sum(map(sum, t[key])) / max(len(t[key]), 1) for key in PHASES}


def tables(runs: list[dict[str, Any]]) -> str:
    head = ["hour", "load req/s"]
    for r in runs:
        head += [f"{r['policy']} serving", f"{r['policy']} SLO"]
    rows = [head]
    for h in range(24):
        if any(h >= len(r["hours"]) for r in runs):
            break
        rows.append([f"{h:02d}", f"{runs[0]['hours'][h]['arrival_rate']:.1f}"])
        for r in runs:
            row = r["hours"][h]
            serving = "+".join(f"{m:.1f}" for m in row["serving_mean"])
            rows[-1] += [serving, _pct(row["slo_attainment"])]
    lines = [format_table(rows), ""]
    rows = [["policy", "SLO (day)", "acc-h (sim)", "acc-h (real day)", "mean replicas", "jobs"]]
    for r in runs:
        met = sum(j["met"] for j in r["jobs"])
        mean = mean_replicas(r)
        rows.append(
            [
                r["policy"],
                _pct(r["slo_attainment"]),
                f"{r['accelerator_hours']:.2f}",
                f"{r['accelerator_hours_real_day']:.1f}",
                f"{mean['serving']:.2f} + {mean['draining']:.2f} dr + {mean['starting']:.2f} st",
                f"{met}/{len(r['jobs'])} by deadline",
            ]
        )
    lines += [format_table(rows), ""]
    for r in runs:
        for j in r["jobs"]:
            done = "not done" if j["completed_hour"] is None else f"{j['completed_hour']:.2f} h"
            lines.append(
                f"{r['policy']}: job {j['job']} submitted {j['submit_hour']:.0f} h, due "
                f"{j['deadline_hour']:.0f} h, done {done} ({j['done_by_deadline']}/"
                f"{j['requests']} by the deadline)"
            )
        for pool, counts in r["autoscaler"].items():
            lines.append(
                f"{r['policy']}/{pool}: {counts['windows']} windows, by reason "
                f"{counts['by_reason']}; {counts['replicas_added']} replicas asked for, "
                f"{counts['replicas_removed']} drained"
            )
    return "\n".join(lines)


def plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    hour_s = result["compression"]["hour_s"]
    fig, axes = plt.subplots(3, len(runs), figsize=(7 * len(runs), 11), squeeze=False)
    for col, r in enumerate(runs):
        top, mid, bottom = axes[0][col], axes[1][col], axes[2][col]
        t = r["timeline"]
        hours = [x / hour_s for x in t["time_s"]]
        for p, pool in enumerate(r["pools"]):
            name = r["policy"] if len(r["pools"]) == 1 else pool
            style = "-" if p == 0 else "--"
            top.step(hours, [s[p] for s in t["serving"]], style, where="post",
                     color="tab:blue", label=f"{name}: serving")  # fmt: skip
            top.step(hours, [s[p] for s in t["starting"]], style, where="post",
                     color="tab:green", label=f"{name}: starting")  # fmt: skip
            top.step(hours, [s[p] for s in t["draining"]], style, where="post",
                     color="tab:red", label=f"{name}: draining")  # fmt: skip
        load = top.twinx()
        arrived = t["interactive_arrived"]
        rate = [
            (arrived[i] - arrived[i - 1]) / (t["time_s"][i] - t["time_s"][i - 1])
            for i in range(1, len(arrived))
        ]
        load.plot(hours[1:], rate, color="gray", alpha=0.5, linewidth=0.8)
        load.plot([h["hour"] + 0.5 for h in r["hours"]], [h["curve_rate"] for h in r["hours"]],
                  color="black", linewidth=1, label="interactive req/s (curve)")  # fmt: skip
        load.set_ylabel("interactive requests/s")
        load.set_ylim(bottom=0)
        top.set_ylabel("replicas")
        top.set_ylim(bottom=0)
        top.set_title(
            f"{r['policy']}: {r['accelerator_hours_real_day']:.1f} accelerator-h a real day, "
            f"SLO {_pct(r['slo_attainment'])}"
        )
        top.legend(loc="upper left", fontsize="x-small")
        load.legend(loc="upper right", fontsize="x-small")

        slo = [h["slo_attainment"] for h in r["hours"]]
        mid.bar([h["hour"] + 0.5 for h in r["hours"]], [100 * (s or 0) for s in slo], width=0.8)
        mid.axhline(95, color="tab:red", linestyle="--", linewidth=1, label="slo_low 95 %")
        mid.set_ylim(min([80.0, *(100 * s for s in slo if s is not None)]) - 1, 100.5)
        mid.set_ylabel("SLO attainment (%)")
        mid.legend(loc="lower left", fontsize="x-small")

        for j in r["jobs"]:
            key = str(j["job"])
            color = f"C{j['job']}"
            done = [tokens.get(key) for tokens in t["batch_output_tokens"]]
            xs = [h for h, d in zip(hours, done, strict=True) if d is not None]
            bottom.plot(xs, [d / 1e6 for d in done if d is not None], color=color,
                        label=f"job {j['job']}")  # fmt: skip
            bottom.axvline(j["deadline_hour"], color=color, linestyle="--", linewidth=1)
            if j["completed_hour"] is not None:
                bottom.plot([j["completed_hour"]], [max(d for d in done if d is not None) / 1e6],
                            "o", color=color)  # fmt: skip
        bottom.set_ylabel("batch output tokens done (M)")
        bottom.set_xlabel(f"curve hour ({hour_s:g} simulated s each; dashed: deadlines)")
        bottom.legend(loc="center right", fontsize="x-small")
        for ax in (top, mid, bottom):
            ax.set_xlim(0, 24.4)  # a deadline at 24 h stays in sight
            ax.set_xticks(range(0, 25, 2))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--policies", default="priority,separate")
    add("--hour-s", type=float, default=60.0, help="simulated s a curve hour lasts")
    add("--peak-rate", type=float, default=60.0, help="interactive req/s at the peak")
    add("--job-requests-real-day", type=int, default=300_000, help="a job, on a real day")
    add("--job-hours", default="0,6,12,16", help="curve hours the jobs are submitted at")
    add("--deadline-h", type=float, default=8.0, help="curve hours from submission")
    add("--max-replicas", type=int, default=8, help="per pool")
    add("--window-s", type=float, default=2.0, help="the autoscaler's window, simulated s")
    add("--startup-s", type=float, default=120.0, help="real s; divided by the compression")
    add("--up-cooldown-s", type=float, default=60.0, help="real s; divided likewise")
    add("--down-cooldown-s", type=float, default=300.0, help="real s; divided likewise")
    add("--tpot-target", type=float, default=0.044, help="the harvest's tpot_target_s")
    add("--seed", type=int, default=0)
    add("--workers", type=int, default=0, help="processes (0: one a policy)")
    add("--out", type=Path, default=Path("bench/results"))
    add("--replot", action="store_true", help="table and PNG again from --out's JSON")
    args = parser.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    args.job_hours = [float(h) for h in args.job_hours.split(",") if h]
    args.num_threads = 1  # the simulator is one Python thread
    if any(p not in POLICY_COLORS for p in args.policies):
        parser.error(f"--policies: each of {sorted(POLICY_COLORS)}")
    if not 0 < args.hour_s <= HOUR_S:
        parser.error("--hour-s must be in (0, 3600]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        result = json.loads((args.out / f"{RESULT_NAME}.json").read_text())
        print(tables(result["runs"]))
        plot(args.out / f"{RESULT_NAME}.png", result)
        return 0
    start = RunStart.now()
    began = time.perf_counter()
    # Each policy in its own process (the runs are independent and deterministic).
    with ProcessPoolExecutor(max_workers=args.workers or len(args.policies)) as pool:
        runs = list(pool.map(run, [args] * len(args.policies), args.policies))
    wall_s = time.perf_counter() - began
    print(tables(runs))
    compression = HOUR_S / args.hour_s
    config = fleet_config(args, args.policies[0])
    scaler = config.policies[0].pools[0].autoscaler
    result = {
        "compression": {
            "hour_s": args.hour_s,
            "factor": compression,
            "day_s": 24 * args.hour_s,
            "note": f"the day is compressed {compression:g}x: each curve hour lasts "
            f"{args.hour_s:g} simulated s; batch volume, submission times and deadlines are "
            "compressed with it, request lengths are not. The autoscaler's startup_s and "
            f"cool-downs are divided by {compression:g}, its window_s is {args.window_s:g} s "
            "(so it reacts faster against the curve than on a real day, and a window holds "
            "fewer requests).",
            "autoscaler": None if scaler is None else vars(scaler),
        },
        "workload": {
            "model": "llama-3-8b",
            "accelerator": "H200",
            "peak_rate": args.peak_rate,
            "jobs": [
                {
                    "submit_hour": h,
                    "deadline_h": args.deadline_h,
                    "requests": job_requests(args),
                    "requests_real_day": args.job_requests_real_day,
                }
                for h in args.job_hours
            ],
            "tpot_target_s": args.tpot_target,
        },
        "runs": runs,
        "wall_s": wall_s,
    }
    out = start.provenance(args) | {"args": args_json(args), **result}
    write_result(args.out, RESULT_NAME, out, lambda path: plot(path, result))
    log(f"{wall_s:.0f} s wall in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
