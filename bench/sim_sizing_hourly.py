"""Sizing, autoscaled hour by hour: accelerator-hours a day for separate pools and for one
pool with priorities (+ harvest) at the stated demand, each pool resized every hour of the
default daily curve, from per-replica capacities measured in the same run.

Demand (docs/simulator.md, Sizing): Llama-3-8B on H200, interactive peak 100 requests/s
and 2 M batch requests a day; Llama-3-70B on H200 TP 4, peak 20 requests/s and 200,000
batch requests a day; batch due in 24 h, ~421 output tokens a request (the batch job's
mean). Roofline cost, harvest `tpot_target_s` 0.044, the sizing's replica settings.

1. Measured per replica (the priority policy on 2 replicas, --duration simulated s a run,
   the router balancing, as bench/sim_sizing.py does): the interactive-alone capacity
   (binary search on the rate for TTFT p50/p99 and TPOT p50/p99 within the targets),
   batch-alone output tokens/s, the capacity with a saturating batch job beside it, and
   the batch tokens/s harvested at every rate tried plus --harvest-fractions of it.
2. Planned, hour h with interactive rate R_h = peak x curve[h]:
   separate  interactive pool: n_h = max(1, ceil(R_h / interactive-alone capacity));
             batch pool: ceil(day's batch tokens / (batch-alone tok/s x 3600))
             replica-hours in all (the fewest that meet the 24 h deadline), placed as flat
             as whole replicas allow, the odd ones in the quietest hours; 0 is allowed.
   one pool  n_h >= max(1, ceil(R_h / priority capacity)), the fewest replica-hours in all
             whose batch harvested, sum_h 3600 x n_h x harvest(R_h / n_h) (harvest
             interpolated between the rates measured), reaches the day's tokens: exact, by
             dynamic programming over the hours (the batch backlog is taken to be there in
             every hour, as 24 h deadlines allow).
   accelerator-hours a day = sum_h n_h x tensor_parallel; fixed pools (the doc's counts
   from these capacities) x 24 beside them. Also kept: the one pool's floor (its first
   term alone) and the batch share that floor harvests, the ratio's ceiling were batch
   free beyond that floor, and separate with a batch replica in every hour.
3. Verified: one run per distinct per-replica rate the plans use (every hour covered; 21
   and 24 runs), as in 1: separate's interactive pool alone, the one pool with the batch
   job. SLO attainment (interactive requests within both p99 targets) weighted by each
   hour's requests, and the one pool's batch made at the measured harvest against the
   day's.

    nice -n 10 .venv/bin/python bench/sim_sizing_hourly.py   # 24 min here (8B 19, 70B 5)
    .venv/bin/python bench/sim_sizing_hourly.py --replan bench/results/sim_sizing_hourly.json
        # plans again from a result's runs (its provenance kept as measured_by), seconds

Writes sim_sizing_hourly.json and sim_sizing_hourly.png into --out.
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

from common.log import log
from common.results import RunStart, args_json, fmt_ms, format_table, write_result

from tokenfleet.sim.config import parse_config
from tokenfleet.sim.report import summarize
from tokenfleet.sim.run import simulate
from tokenfleet.sim.workload import DEFAULT_DAILY_CURVE, BatchJob

RESULT_NAME = "sim_sizing_hourly"
DEPLOYMENTS = {
    "llama-3-8b / H200": {"model": "llama-3-8b", "tensor_parallel": 1, "peak": 100.0,
                          "daily_batch": 2_000_000},
    "llama-3-70b / H200 TP4": {"model": "llama-3-70b", "tensor_parallel": 4, "peak": 20.0,
                               "daily_batch": 200_000},
}  # fmt: skip
REPLICAS = 2  # simulated a run; per-replica figures carry over (the router balances)
BATCH = 100_000  # a saturating job
GOAL = 1.5  # separate / one pool, accelerator-hours a day


# -- measuring (bench/sim_sizing.py's runs; a script never imports another) ------------


def run(deployment: dict[str, Any], rate: float, batch: bool, duration: float) -> dict[str, Any]:
    """The priority policy on REPLICAS replicas at `rate` interactive requests/s each."""
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
            "policies": [{"name": "priority", "replicas": REPLICAS}],
            "replica": {"tpot_target_s": deployment["tpot_target_s"]},
            "sample_s": duration,
        }
    )
    began = time.perf_counter()
    s = summarize(simulate(config, config.policies[0]), config.targets)
    interactive, made = s["classes"]["interactive"], s["classes"]["batch"]
    # Batch output made in the window, finished or not (a short window ends most unfinished).
    tokens = made["output_tokens"] + made["unfinished_output_tokens"]
    return {
        "rate_per_replica": rate,
        "batch": batch,
        "met": s["targets_met"],
        "slo_attainment": s["slo_attainment"],
        "interactive": {k: interactive[k] for k in ("ttft_s", "tpot_s", "finished")},
        "batch_tokens_per_replica_s": tokens / duration / REPLICAS,
        "wall_s": time.perf_counter() - began,
    }


def logged_run(
    deployment: dict[str, Any], rate: float, batch: bool, duration: float, why: str
) -> dict[str, Any]:
    r = run(deployment, rate, batch, duration)
    i = r["interactive"]
    log(
        f"  {why:<12} batch={batch!s:<5} {rate:6.2f}/s/replica met={r['met']!s:<5} "
        f"TTFT {fmt_ms(i['ttft_s']['p50'])}/{fmt_ms(i['ttft_s']['p99'])} "
        f"TPOT {fmt_ms(i['tpot_s']['p50'])}/{fmt_ms(i['tpot_s']['p99'])} ms "
        f"SLO {_pct(r['slo_attainment'])} batch {r['batch_tokens_per_replica_s']:,.0f} tok/s "
        f"({r['wall_s']:.0f} s wall)"
    )
    return r | {"why": why}


def capacity(
    deployment: dict[str, Any], batch: bool, duration: float, runs: list[dict[str, Any]]
) -> float:
    """The highest rate meeting the targets over a binary search (log scale, 0.25 to 32)."""
    low, high, best = 0.25, 32.0, 0.0
    for _ in range(6):
        rate = math.sqrt(low * high)
        r = logged_run(deployment, rate, batch, duration, "search")
        runs.append(r)
        low, high, best = (rate, high, rate) if r["met"] else (low, rate, best)
    if best == 0.0:
        raise RuntimeError(f"targets not met at 0.25/s per replica or more ({batch=})")
    return best


def measure(deployment: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    alone = capacity(deployment, False, args.duration, runs)
    batch_alone = logged_run(deployment, 0.0, True, args.duration, "batch alone")
    runs.append(batch_alone)
    priority = capacity(deployment, True, args.duration, runs)
    for fraction in args.harvest_fractions:
        rate = fraction * priority
        runs.append(logged_run(deployment, rate, True, args.duration, "harvest"))
    return {
        "interactive_capacity": alone,
        "priority_capacity": priority,
        "batch_alone_tokens_s": batch_alone["batch_tokens_per_replica_s"],
        "runs": runs,
    }


def mean_output_tokens(samples: int = 100_000) -> float:
    """The batch job's mean output length (a lognormal's mean, above its 256 median)."""
    rng = random.Random(0)
    lengths = BatchJob().lengths
    return statistics.fmean(lengths.draw(rng)[1] for _ in range(samples))


# -- planning -----------------------------------------------------------------------------


def harvest_points(measured: dict[str, Any]) -> list[tuple[float, float]]:
    """(rate per replica, batch tok/s per replica) with the batch job, up to the priority
    capacity; rate 0 is batch alone."""
    points = {0.0: measured["batch_alone_tokens_s"]}
    for r in measured["runs"]:
        if r["batch"] and 0 < r["rate_per_replica"] <= measured["priority_capacity"]:
            points[r["rate_per_replica"]] = r["batch_tokens_per_replica_s"]
    return sorted(points.items())


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def plan_separate(
    rates: list[float], capacity: float, alone_tokens_s: float, daily_tokens: float
) -> dict[str, list[int]]:
    """Interactive replicas per hour at capacity; the batch pool's fewest replica-hours,
    flat, the odd ones in the hours of least interactive traffic."""
    interactive = [max(1, math.ceil(r / capacity - 1e-9)) for r in rates]
    batch_hours = math.ceil(daily_tokens / (alone_tokens_s * 3600))
    batch = [batch_hours // len(rates)] * len(rates)
    for h in sorted(range(len(rates)), key=lambda h: (rates[h], h))[: batch_hours % len(rates)]:
        batch[h] += 1
    return {"interactive": interactive, "batch": batch}


def plan_one_pool(
    rates: list[float], capacity: float, points: list[tuple[float, float]], daily_tokens: float
) -> list[int]:
    """The fewest replica-hours, each hour carrying its rate within `capacity`, whose batch
    harvest over the day reaches `daily_tokens` (exact: dynamic programming over hours)."""
    lows = [max(1, math.ceil(r / capacity - 1e-9)) for r in rates]
    alone = points[0][1]
    # Never more extra replica-hours than batch alone would need twice over.
    extra = 2 * math.ceil(daily_tokens / (alone * 3600)) + len(rates)

    def made(h: int, n: int) -> float:
        return 3600 * n * interpolate(points, rates[h] / n)

    # best[k]: the most batch with k extra replica-hours over the hours so far, and how.
    best: list[tuple[float, tuple[int, ...]] | None] = [(0.0, ())] + [None] * extra
    for h in range(len(rates)):
        step: list[tuple[float, tuple[int, ...]] | None] = [None] * (extra + 1)
        for k, found in enumerate(best):
            if found is None:
                continue
            for add in range(extra + 1 - k):
                tokens = found[0] + made(h, lows[h] + add)
                held = step[k + add]
                if held is None or tokens > held[0]:
                    step[k + add] = (tokens, (*found[1], lows[h] + add))
        best = step
    for found in best:
        if found is not None and found[0] >= daily_tokens:
            return list(found[1])
    raise ValueError("no plan within the bound carries the batch")


def fixed_one_pool(
    rates: list[float], capacity: float, points: list[tuple[float, float]], daily_tokens: float
) -> int:
    """bench/sim_sizing.py's count: the fewest replicas, the same all day, carrying the
    peak and the day's batch."""
    n = math.ceil(max(rates) / capacity - 1e-9)
    while sum(3600 * n * interpolate(points, r / n) for r in rates) < daily_tokens:
        n += 1
    return n


def plan(deployment: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    tp, peak = deployment["tensor_parallel"], deployment["peak"]
    rates = [peak * f for f in DEFAULT_DAILY_CURVE]
    daily_tokens = deployment["daily_batch"] * deployment["batch_output_tokens"]
    alone_tokens_s = measured["batch_alone_tokens_s"]
    points = harvest_points(measured)
    separate = plan_separate(rates, measured["interactive_capacity"], alone_tokens_s, daily_tokens)
    one = plan_one_pool(rates, measured["priority_capacity"], points, daily_tokens)
    separate_h = tp * (sum(separate["interactive"]) + sum(separate["batch"]))
    one_h = tp * sum(one)
    fixed_separate = math.ceil(peak / measured["interactive_capacity"]) + math.ceil(
        daily_tokens / (alone_tokens_s * 86400)
    )
    fixed_one = fixed_one_pool(rates, measured["priority_capacity"], points, daily_tokens)
    floor = [max(1, math.ceil(r / measured["priority_capacity"] - 1e-9)) for r in rates]
    floor_batch = sum(
        3600 * n * interpolate(points, r / n) for r, n in zip(rates, floor, strict=True)
    )
    batch_min_1 = sum(max(1, n) for n in separate["batch"])
    return {
        "interactive_rate": rates,
        "daily_batch_tokens": daily_tokens,
        "harvest_points": points,
        "separate": separate,
        "one_pool": one,
        "one_pool_batch_planned": [
            3600 * n * interpolate(points, r / n) for r, n in zip(rates, one, strict=True)
        ],
        "accelerator_hours": {"separate": separate_h, "one_pool": one_h},
        "ratio": separate_h / one_h,
        "fixed_accelerator_hours": {
            "separate": 24 * tp * fixed_separate,
            "one_pool": 24 * tp * fixed_one,
        },
        # Where the ratio comes from: the one pool's floor (its interactive at capacity)
        # and the share of the day's batch that floor harvests; the ratio if batch cost the
        # one pool nothing beyond its floor; separate with a batch replica in every hour.
        "breakdown": {
            "separate_interactive_replica_hours": sum(separate["interactive"]),
            "separate_batch_replica_hours": sum(separate["batch"]),
            "one_pool_floor_replica_hours": sum(floor),
            "one_pool_extra_replica_hours": sum(one) - sum(floor),
            "floor_batch_share_of_day": floor_batch / daily_tokens,
            "ratio_bound": (sum(separate["interactive"]) + sum(separate["batch"])) / sum(floor),
            "separate_batch_min_1_accelerator_hours": tp
            * (sum(separate["interactive"]) + batch_min_1),
            "ratio_batch_min_1": (sum(separate["interactive"]) + batch_min_1) / sum(one),
        },
    }


# -- verifying ----------------------------------------------------------------------------


def hourly_runs(planned: dict[str, Any]) -> list[tuple[str, float, bool]]:
    """(policy, rate per replica, with batch) for every hour of both plans, distinct."""
    rates = planned["interactive_rate"]
    wanted = [
        ("separate", _key(r / n), False)
        for r, n in zip(rates, planned["separate"]["interactive"], strict=True)
    ]
    wanted += [
        ("one_pool", _key(r / n), True) for r, n in zip(rates, planned["one_pool"], strict=True)
    ]
    return sorted(set(wanted))


def _key(rate: float) -> float:
    return round(rate, 3)


def verify(
    deployment: dict[str, Any], planned: dict[str, Any], runs: dict[tuple[str, float], Any]
) -> dict[str, Any]:
    """Each hour's attainment and (one pool) batch made from the run at its per-replica
    rate; the day's attainment weighted by the hour's interactive requests."""
    rates = planned["interactive_rate"]
    plans = {"separate": planned["separate"]["interactive"], "one_pool": planned["one_pool"]}
    out: dict[str, Any] = {}
    for policy, counts in plans.items():
        hours = [runs.get((policy, _key(r / n))) for r, n in zip(rates, counts, strict=True)]
        known = [
            (r, h)
            for r, h in zip(rates, hours, strict=True)
            if h and h["slo_attainment"] is not None
        ]
        out[policy] = {
            "hourly_slo_attainment": [h and h["slo_attainment"] for h in hours],
            "hourly_targets_met": [h and h["met"] for h in hours],
            "slo_attainment": sum(r * h["slo_attainment"] for r, h in known)
            / sum(r for r, _ in known)
            if known
            else None,
            "hours_verified": len(known),
            "hours_targets_met": sum(bool(h and h["met"]) for h in hours),
        }
    made = [
        None
        if (h := runs.get(("one_pool", _key(r / n)))) is None
        else 3600 * n * h["batch_tokens_per_replica_s"]
        for r, n in zip(rates, planned["one_pool"], strict=True)
    ]
    out["one_pool"]["hourly_batch_tokens"] = made
    if all(m is not None for m in made):
        out["one_pool"]["batch_tokens"] = sum(m for m in made if m is not None)
        out["one_pool"]["batch_share_of_day"] = (
            out["one_pool"]["batch_tokens"] / planned["daily_batch_tokens"]
        )
    return out


# -- report -------------------------------------------------------------------------------


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}%}"


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        [
            "deployment",
            "policy",
            "acc-h/day autoscaled",
            "acc-h/day fixed",
            "SLO (day)",
            "hours met",
            "batch made / day's",
        ]
    ]
    for r in results:
        p, v = r["plan"], r["verified"]
        for policy, label in (("separate", "separate pools"), ("one_pool", "one pool, priority")):
            batch = v[policy].get("batch_share_of_day") if policy == "one_pool" else None
            rows.append(
                [
                    r["deployment"],
                    label,
                    f"{p['accelerator_hours'][policy]:,}",
                    f"{p['fixed_accelerator_hours'][policy]:,}",
                    _pct(v[policy]["slo_attainment"], 2),
                    f"{v[policy]['hours_targets_met']}/24",
                    "by plan" if batch is None else _pct(batch),
                ]
            )
        fixed = p["fixed_accelerator_hours"]
        rows.append(
            [
                r["deployment"],
                "ratio separate / one pool",
                f"{p['ratio']:.2f}x",
                f"{fixed['separate'] / fixed['one_pool']:.2f}x",
                "",
                "",
                "",
            ]
        )
    return format_table(rows)


def hours_table(result: dict[str, Any]) -> str:
    p = result["plan"]
    rows = [["hour", "req/s", "separate int+batch", "one pool", "SLO sep", "SLO one"]]
    for h, rate in enumerate(p["interactive_rate"]):
        rows.append(
            [
                f"{h:02d}",
                f"{rate:g}",
                f"{p['separate']['interactive'][h]}+{p['separate']['batch'][h]}",
                f"{p['one_pool'][h]}",
                _pct(result["verified"]["separate"]["hourly_slo_attainment"][h]),
                _pct(result["verified"]["one_pool"]["hourly_slo_attainment"][h]),
            ]
        )
    return format_table(rows)


def plot(path: Path, results: list[dict[str, Any]]) -> None:
    """Per deployment: separate's two pools stacked, the one pool's line, and the
    interactive load (fleet-wide) on the right axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5.5), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        p, tp = r["plan"], r["tensor_parallel"]
        hours = range(25)
        interactive, batch = p["separate"]["interactive"], p["separate"]["batch"]
        both = [a + b for a, b in zip(interactive, batch, strict=True)]
        ax.fill_between(
            hours,
            [*interactive, interactive[-1]],
            step="post",
            color="tab:blue",
            alpha=0.35,
            label="separate: interactive pool",
        )
        ax.fill_between(
            hours,
            [*interactive, interactive[-1]],
            [*both, both[-1]],
            step="post",
            color="tab:green",
            alpha=0.3,
            label="separate: batch pool (on top)",
        )
        _step(ax, p["one_pool"], color="tab:orange", linewidth=2, label="one pool, priority")
        ax.set_xlim(0, 24)
        ax.set_xticks(range(0, 25, 3))
        ax.set_ylim(0, 1.15 * max(*both, *p["one_pool"]))
        ax.set_xlabel("hour of the day")
        ax.set_ylabel(f"replicas (x{tp} accelerators)")
        ah = p["accelerator_hours"]
        ax.set_title(
            f"{r['deployment']}: {ah['separate']:,} vs {ah['one_pool']:,} acc-h/day "
            f"({p['ratio']:.2f}x)",
            fontsize="medium",
        )
        load = ax.twinx()
        _step(load, p["interactive_rate"], color="black", linestyle=":", label="interactive req/s")
        load.set_ylabel("interactive requests/s (fleet)")
        load.set_ylim(0, 1.15 * max(p["interactive_rate"]))
        lines = ax.get_legend_handles_labels()
        more = load.get_legend_handles_labels()
        ax.legend(
            lines[0] + more[0],
            lines[1] + more[1],
            fontsize="small",
            ncol=2,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.12),
        )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _step(ax: Any, hourly: list[Any], **kw: Any) -> None:
    """`hourly` as steps over the 24 hours."""
    ax.step(range(len(hourly) + 1), [*hourly, hourly[-1]], where="post", **kw)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--duration", type=float, default=60.0, help="simulated s a measuring run")
    add("--verify-duration", type=float, default=60.0, help="simulated s a verifying run")
    add("--harvest-fractions", default="0.15,0.3,0.5", help="of the priority capacity")
    add("--tpot-target", type=float, default=0.044, help="the harvest's tpot_target_s")
    add("--only", choices=list(DEPLOYMENTS), help="one deployment")
    add("--no-verify", action="store_true", help="plan only, no verifying runs")
    add("--replan", type=Path, help="a result JSON: plan again from its runs, run nothing")
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    args.harvest_fractions = [float(f) for f in args.harvest_fractions.split(",") if f]
    args.num_threads = 1  # the simulator is one Python thread
    return args


def size(name: str, args: argparse.Namespace, before: dict[str, Any] | None) -> dict[str, Any]:
    """Measure (or take `before`'s runs), plan, verify one deployment."""
    began = time.perf_counter()
    deployment = DEPLOYMENTS[name] | {
        "tpot_target_s": args.tpot_target,
        "batch_output_tokens": mean_output_tokens(),
    }
    measured = before["measured"] if before else measure(deployment, args)
    log(
        f"{name}: interactive alone {measured['interactive_capacity']:.2f}/s, priority + batch "
        f"{measured['priority_capacity']:.2f}/s, batch alone "
        f"{measured['batch_alone_tokens_s']:,.0f} tok/s per replica"
    )
    planned = plan(deployment, measured)
    done = before["verification_runs"] if before else []
    runs = {(r["policy"], _key(r["rate_per_replica"])): r for r in done}
    wanted = [] if args.no_verify or before else hourly_runs(planned)
    log(f"{name}: verifying {len(wanted)} distinct per-replica rates")
    for policy, rate, batch in wanted:
        if (policy, rate) not in runs:
            r = logged_run(deployment, rate, batch, args.verify_duration, policy) | {
                "policy": policy
            }
            runs[(policy, rate)] = r
            done.append(r)
    return {
        "deployment": name,
        **deployment,
        "window_s": args.duration,
        "verify_window_s": args.verify_duration,
        "measured": measured,
        "plan": planned,
        "verification_runs": done,
        "verified": verify(deployment, planned, runs),
        "wall_s": before.get("wall_s") if before else time.perf_counter() - began,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = RunStart.now()
    before, measured_by = {}, None
    if args.replan:
        given = json.loads(args.replan.read_text())
        before = {r["deployment"]: r for r in given["results"]}
        keys = ("command", "date", "machine")
        measured_by = given.get("measured_by") or {k: given.get(k) for k in keys}
    results: list[dict[str, Any]] = []
    for name in DEPLOYMENTS:
        if (args.only and args.only != name) or (args.replan and name not in before):
            continue
        log(name)
        results.append(size(name, args, before.get(name)))
        print(hours_table(results[-1]))
        # Written after each deployment: a long run keeps what it measured.
        out = start.provenance(args) | {"args": args_json(args), "measured_by": measured_by}
        out["goal_ratio"] = GOAL
        write_result(
            args.out, RESULT_NAME, out | {"results": results}, lambda path: plot(path, results)
        )
    print(table(results))
    for r in results:
        met = "met" if r["plan"]["ratio"] >= GOAL else "not met"
        b = r["plan"]["breakdown"]
        print(
            f"goal ({GOAL}x), {r['deployment']}: {r['plan']['ratio']:.2f}x, {met}; separate "
            f"{b['separate_interactive_replica_hours']} interactive + "
            f"{b['separate_batch_replica_hours']} batch replica-hours, one pool "
            f"{b['one_pool_floor_replica_hours']} floor (harvesting "
            f"{b['floor_batch_share_of_day']:.0%} of the batch) + "
            f"{b['one_pool_extra_replica_hours']}; at most {b['ratio_bound']:.2f}x with batch "
            f"free beyond the floor; {b['ratio_batch_min_1']:.2f}x with a batch replica every hour"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
