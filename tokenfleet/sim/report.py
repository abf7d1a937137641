"""A simulation's report: one summary per fleet policy, rendered as a table, JSON and a
PNG (matplotlib, imported only to draw).

Per policy: TTFT and TPOT p50/p90/p99 by class, whether the design's targets are met,
SLO attainment (interactive requests within both p99 targets, of those finished or
refused), tokens per accelerator-hour, batch jobs done against their deadlines, each
autoscaled pool's decisions counted by reason, and over time: replicas (serving,
starting, draining) and KV use per pool, interactive requests arrived, finished and
within targets, and batch output tokens done per job. A sampled run's totals (requests,
tokens, accelerator-hours, replicas, a job's requests) are scaled back to the fleet it
stands for; its percentiles and ratios are its own; engine steps and wall time are the
sample's (what the simulation did).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenfleet.fleet.autoscaler import ScaleDecision
from tokenfleet.loadgen.report import percentile
from tokenfleet.sim.metrics import ClassLog, Targets
from tokenfleet.sim.run import PolicyResult
from tokenfleet.sim.sampling import Sampling
from tokenfleet.sim.workload import INTERACTIVE

PERCENTILES = (50, 90, 99)


def _latency(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in PERCENTILES}


def _class_summary(log: ClassLog, total: Any) -> dict[str, Any]:
    return {
        "finished": total(log.num_finished),
        "unfinished": total(log.num_unfinished),
        "refused": total(log.num_refused),
        "within_targets": total(log.num_met),
        "prompt_tokens": total(log.prompt_tokens),
        "output_tokens": total(log.output_tokens),
        "unfinished_output_tokens": total(log.unfinished_output_tokens),
        "ttft_s": _latency(log.ttft_s),
        "tpot_s": _latency(log.tpot_s),
    }


def targets_met(summary: dict[str, Any], targets: Targets) -> bool:
    """Whether interactive TTFT and TPOT p50 and p99 are all within the targets."""
    ttft, tpot = summary["ttft_s"], summary["tpot_s"]
    values = [ttft["p50"], ttft["p99"], tpot["p50"], tpot["p99"]]
    limits = [targets.ttft_p50_s, targets.ttft_p99_s, targets.tpot_p50_s, targets.tpot_p99_s]
    return all(v is not None and v <= limit for v, limit in zip(values, limits, strict=True))


def _sampling(sampling: Sampling | None) -> dict[str, Any] | None:
    if sampling is None:
        return None
    return {
        "simulated_replicas": sampling.num_simulated,
        "replicas": sampling.num_replicas,
        "traffic_fraction": sampling.fraction,
    }


def decision_counts(decisions: Sequence[ScaleDecision]) -> dict[str, Any]:
    """A pool's autoscaler decisions: windows by reason, and the changes up and down
    (replicas asked for and drained)."""
    reasons = Counter(d.reason for d in decisions)
    return {
        "windows": len(decisions),
        "by_reason": dict(sorted(reasons.items())),
        "scale_ups": sum(d.target > d.num_replicas for d in decisions),
        "scale_downs": sum(d.target < d.num_replicas for d in decisions),
        "replicas_added": sum(max(d.target - d.num_replicas, 0) for d in decisions),
        "replicas_removed": sum(max(d.num_replicas - d.target, 0) for d in decisions),
    }


def summarize(result: PolicyResult, targets: Targets) -> dict[str, Any]:
    m = result.metrics
    sampling = result.sampling

    def total(value: int) -> int:
        """A count of the run, for the fleet the run stands for."""
        return value if sampling is None else round(sampling.total(value))

    own = {kind: _class_summary(log, lambda v: v) for kind, log in m.classes.items()}
    classes = {kind: _class_summary(log, total) for kind, log in m.classes.items()}
    interactive = own[INTERACTIVE]
    # Requests still running at the end are left out: their latencies are not known.
    sent = interactive["finished"] + interactive["refused"]
    tokens = sum(
        c["prompt_tokens"] + c["output_tokens"] + c["unfinished_output_tokens"]
        for c in own.values()
    )
    # Tokens made, finished or not: a short run would otherwise miss long outputs.
    output = sum(c["output_tokens"] + c["unfinished_output_tokens"] for c in own.values())
    hours = m.accelerator_s / 3600
    return {
        "policy": result.policy.name,
        "pools": [asdict(p) for p in result.policy.pools],
        "sampling": _sampling(sampling),
        "classes": classes,
        "targets": asdict(targets),
        "targets_met": targets_met(interactive, targets),
        "slo_attainment": interactive["within_targets"] / sent if sent else None,
        "accelerator_hours": hours if sampling is None else sampling.total(hours),
        "tokens_per_accelerator_hour": tokens / hours if hours else None,
        "output_tokens_per_accelerator_hour": output / hours if hours else None,
        "batch_jobs": [
            {
                "job": j.job_id,
                "requests": total(j.num_requests),
                "done": total(j.num_done),
                "done_by_deadline": total(j.num_done_in_time),
                "deadline_at_s": j.deadline_at,
                "last_done_at_s": j.last_done_at,
            }
            for j in result.jobs
        ],
        "timeline": {
            "time_s": [s.time_s for s in m.samples],
            "replicas": [[total(n) for n in s.replicas] for s in m.samples],
            "starting": [[total(n) for n in s.starting] for s in m.samples],
            "draining": [[total(n) for n in s.draining] for s in m.samples],
            "kv_usage": [s.kv_usage for s in m.samples],
            "interactive_arrived": [total(s.interactive_arrived) for s in m.samples],
            "interactive_finished": [total(s.interactive_finished) for s in m.samples],
            "interactive_refused": [total(s.interactive_refused) for s in m.samples],
            "interactive_met": [total(s.interactive_met) for s in m.samples],
            "batch_output_tokens": [
                {str(job): total(n) for job, n in s.batch_output_tokens.items()} for s in m.samples
            ],
        },
        "autoscaler": {pool: decision_counts(d) for pool, d in result.decisions.items()},
        "engine_steps": m.num_steps,
        "steps_leapt": m.num_leap_steps,
        "wall_s": result.wall_s,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'policy':<10}{'class':<12}{'done':>8}{'unfin':>7}{'TTFT ms p50/p90/p99':>22}"
        f"{'TPOT ms p50/p90/p99':>22}{'tok/acc-h':>12}{'SLO':>7}{'met':>5}"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        rate = s["tokens_per_accelerator_hour"]
        for kind, c in s["classes"].items():
            ttft = "/".join(_ms(c["ttft_s"][f"p{q}"]) for q in PERCENTILES)
            tpot = "/".join(_ms(c["tpot_s"][f"p{q}"]) for q in PERCENTILES)
            interactive = kind == INTERACTIVE
            slo = s["slo_attainment"] if interactive else None
            lines.append(
                f"{s['policy']:<10}{kind:<12}{c['finished']:>8}{c['unfinished']:>7}{ttft:>22}"
                f"{tpot:>22}{'' if not interactive or rate is None else f'{rate:,.0f}':>12}"
                f"{'' if slo is None else f'{slo:.1%}':>7}"
                f"{('yes' if s['targets_met'] else 'no') if interactive else '':>5}"
            )
        for job in s["batch_jobs"]:
            lines.append(
                f"{'':<10}batch job {job['job']}: {job['done_by_deadline']}/{job['requests']} "
                f"done by its deadline ({job['done']} done in all)"
            )
        for pool, counts in s.get("autoscaler", {}).items():
            reasons = ", ".join(f"{k} {v}" for k, v in counts["by_reason"].items())
            lines.append(
                f"{'':<10}autoscaler {pool}: {counts['windows']} windows ({reasons}); "
                f"{counts['replicas_added']} replicas asked for, {counts['replicas_removed']} "
                "drained"
            )
        sample = s.get("sampling")
        lines.append(
            f"{'':<10}{s['accelerator_hours']:.3g} accelerator-hours, {s['engine_steps']:,} "
            f"engine steps ({s['steps_leapt']:,} leapt), {s['wall_s']:.1f} s wall"
            + (
                ""
                if sample is None
                else f"; sampled: {sample['simulated_replicas']} of {sample['replicas']} "
                "replicas simulated, totals scaled to all of them"
            )
        )
    return "\n".join(lines)


def write_json(path: Path, summaries: Sequence[dict[str, Any]]) -> None:
    path.write_text(json.dumps(list(summaries), indent=1))


def plot(path: Path, summaries: Sequence[dict[str, Any]]) -> None:
    """Replicas and KV use over time, per policy and pool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (replicas_ax, kv_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for s in summaries:
        hours = [t / 3600 for t in s["timeline"]["time_s"]]
        for i, pool in enumerate(s["pools"]):
            label = f"{s['policy']}/{pool['name']}"
            replicas_ax.step(hours, [r[i] for r in s["timeline"]["replicas"]], label=label)
            kv_ax.plot(hours, [u[i] for u in s["timeline"]["kv_usage"]], label=label)
    replicas_ax.set_ylabel("replicas")
    kv_ax.set_ylabel("KV blocks in use (share)")
    kv_ax.set_xlabel("simulated hours")
    replicas_ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
