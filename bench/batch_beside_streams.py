"""Where the batch goes while interactive streams run: the engine in this process, the
mixed-load benchmark's batch all added at the start, and one interactive request at a
time (each starting `--gap` seconds after the one before ended), under the priority
policy with mixed_load's (m) settings by default. Every step is recorded: its time, the
harvest budget the batch got, batch and interactive output tokens, requests running and
waiting, and whether an interactive request was in the engine. The summary splits the
steps after `--warm-up` into those two phases: batch tokens/s, the budget, the running
batch.

bench/mixed_load.py measures the same policy through the server, against peers; this
answers why its batch tokens/s are what they are, step by step.

    .venv/bin/python bench/batch_beside_streams.py                           # ~3 minutes
    .venv/bin/python bench/batch_beside_streams.py --batch-step-limit 0      # no step limit

Writes batch_beside_streams.json and .png into --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.batch import add_batch
from common.results import write_results
from tqdm import tqdm

from tokenfleet import LLM, SamplingParams
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.request import PRIORITY_INTERACTIVE
from tokenfleet.loadgen.workload import build_workload, prompt_text

RESULT_NAME = "batch_beside_streams"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--tpot-target", type=float, default=0.155, help="seconds ((m) in the last mixed-load run)")
    add("--harvest-margin", type=float, default=0.1)
    add(
        "--batch-step-limit",
        type=float,
        default=0.514,
        help="seconds, 0 for none (default: (m)'s, 0.2 x the TTFT target)",
    )
    add("--duration", type=float, default=150.0, help="seconds of steps (default %(default)s)")
    add("--warm-up", type=float, default=20.0, help="seconds left out of the summary")
    add("--first-at", type=float, default=5.0, help="the first interactive request (s)")
    add("--gap", type=float, default=3.0, help="seconds from one interactive end to the next")
    add(
        "--rate",
        type=float,
        default=0.0,
        help="interactive requests/s as mixed_load's workload draws them (Poisson arrivals, "
        "its seeded lengths and prompts, any number at once) instead of one at a time",
    )
    add("--interactive-prompt-len", type=int, default=216, help="(the workload's mean)")
    add("--interactive-output-len", type=int, default=53, help="(the workload's mean)")
    add("--num-requests", type=int, default=200, help="batch requests")
    add("--num-threads", type=int, default=1)
    add("--max-model-len", type=int, default=2048)
    add("--seed", type=int, default=0)
    add("--out", type=Path, default=Path("bench/results"))
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(
        num_threads=args.num_threads,
        overlap=False,  # steps one after another: each step's prediction and time its own
        max_model_len=args.max_model_len,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        tpot_target_s=args.tpot_target,
        harvest_margin=args.harvest_margin,
        batch_step_limit_s=args.batch_step_limit or None,
    )
    workload, specs, _ = add_batch(
        llm, args.num_requests, max_model_len=args.max_model_len, seed=args.seed
    )
    core, tokenizer = llm.engine, llm.tokenizer
    prompt = tokenizer.encode(prompt_text(workload, specs[0]) * 8)[: args.interactive_prompt_len]
    interactive = SamplingParams(
        max_tokens=args.interactive_output_len, temperature=0, ignore_eos=True
    )
    # --rate: (arrival s, prompt ids, params) of the workload's interactive requests.
    arrivals: list[tuple[float, list[int], SamplingParams]] = []
    if args.rate:
        drawn = replace(workload, rate=args.rate, duration_s=args.duration, num_batch=0)
        for spec in build_workload(drawn):
            ids = tokenizer.encode(prompt_text(drawn, spec))
            params = SamplingParams(max_tokens=spec.output_len, temperature=0, ignore_eos=True)
            arrivals.append((args.first_at + spec.arrival_s, ids, params))
    steps: list[dict[str, Any]] = []
    active: set[str] = set()
    next_at, count = args.first_at, 0
    started = time.perf_counter()
    with tqdm(total=round(args.duration), desc="seconds", unit="s") as bar:
        while (now := time.perf_counter() - started) < args.duration:
            if args.rate:
                while arrivals and arrivals[0][0] <= now:
                    _, ids, params = arrivals.pop(0)
                    req_id, count = f"i{count}", count + 1
                    active.add(req_id)
                    core.add_request(
                        EngineCoreRequest(
                            req_id, ids, params, time.monotonic(), PRIORITY_INTERACTIVE
                        )
                    )
            elif not active and now >= next_at:
                req_id, count = f"i{count}", count + 1
                active.add(req_id)
                request = EngineCoreRequest(
                    req_id, prompt, interactive, time.monotonic(), PRIORITY_INTERACTIVE
                )
                core.add_request(request)
            began = time.perf_counter()
            out = core.step()
            seconds = time.perf_counter() - began
            scheduler = core.scheduler
            steps.append(
                {
                    "t_s": began - started,
                    "seconds": seconds,
                    "predicted_s": core.last_prediction or 0.0,
                    "batch_budget": core.last_batch_token_budget,
                    "batch_tokens": sum(
                        len(o.new_token_ids) for o in out.outputs if o.req_id[0] == "b"
                    ),
                    "interactive_tokens": sum(
                        len(o.new_token_ids) for o in out.outputs if o.req_id[0] == "i"
                    ),
                    "running_batch": sum(not r.is_interactive for r in scheduler.running),
                    "running_interactive": len(active),
                    "interactive": bool(active),
                }
            )
            done = {o.req_id for o in out.outputs if o.finished and o.req_id in active}
            if done:
                active -= done
                if not active:
                    next_at = time.perf_counter() - started + args.gap
            bar.update(round(time.perf_counter() - started) - bar.n)
    return {"num_interactive": count, "steps": steps, "phases": phases(steps, args.warm_up)}


def phases(steps: list[dict[str, Any]], warm_up_s: float) -> dict[str, Any]:
    """The steps after the warm-up, with and without an interactive request in the engine."""
    summary: dict[str, Any] = {}
    for name, flag in (("interactive", True), ("batch_only", False)):
        chosen = [s for s in steps if s["interactive"] == flag and s["t_s"] >= warm_up_s]
        if not chosen:
            continue
        seconds = sum(s["seconds"] for s in chosen)
        summary[name] = {
            "steps": len(chosen),
            "seconds": seconds,
            "batch_tokens_per_s": sum(s["batch_tokens"] for s in chosen) / seconds,
            "step_s_median": statistics.median(s["seconds"] for s in chosen),
            "predicted_s_median": statistics.median(s["predicted_s"] for s in chosen),
            "batch_budget_median": statistics.median(s["batch_budget"] or 0 for s in chosen),
            "running_batch_median": statistics.median(s["running_batch"] for s in chosen),
            "batch_tokens_per_step_mean": statistics.mean(s["batch_tokens"] for s in chosen),
            "running_interactive_mean": statistics.mean(s["running_interactive"] for s in chosen),
        }
    return summary


def plot(path: Path, result: dict[str, Any], title: str) -> None:
    from matplotlib.figure import Figure

    steps = result["steps"]
    fig = Figure(figsize=(11, 5), layout="constrained")
    ax = fig.subplots()
    ts = [s["t_s"] for s in steps]
    ax.plot(ts, [s["batch_budget"] or 0 for s in steps], lw=0.7, label="batch token budget")
    ax.plot(ts, [s["running_batch"] for s in steps], lw=0.9, label="batch requests running")
    ax.plot(ts, [s["batch_tokens"] for s in steps], lw=0.7, label="batch output tokens")
    for s in steps:
        if s["interactive"]:
            ax.axvspan(s["t_s"], s["t_s"] + s["seconds"], color="0.9", lw=0)
    ax.set_yscale("symlog")
    ax.set_xlabel("s (grey: an interactive request in the engine)")
    ax.set_ylabel("per step")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    date = datetime.now(UTC).isoformat(timespec="seconds")
    result = run(args)
    lines = []
    for name, p in result["phases"].items():
        lines.append(
            f"{name}: {p['steps']} steps, {p['seconds']:.1f} s, batch "
            f"{p['batch_tokens_per_s']:.1f} tok/s, step median {p['step_s_median'] * 1e3:.0f} ms "
            f"(predicted {p['predicted_s_median'] * 1e3:.0f}), budget median "
            f"{p['batch_budget_median']}, batch running median {p['running_batch_median']}, "
            f"batch tokens a step {p['batch_tokens_per_step_mean']:.1f}, interactive "
            f"requests in the engine, mean {p['running_interactive_mean']:.1f}"
        )
    print("\n".join(lines))
    limit = f"{args.batch_step_limit:.3f} s" if args.batch_step_limit else "none"
    rates = ", ".join(
        f"{name} {p['batch_tokens_per_s']:.1f}" for name, p in result["phases"].items()
    )
    title = f"TPOT target {args.tpot_target * 1e3:.0f} ms, batch step limit {limit}"
    write_results(
        args,
        RESULT_NAME,
        date,
        result,
        lambda path: plot(path, result, f"{title}; batch tok/s: {rates}"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
