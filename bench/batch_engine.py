"""The engine alone on the mixed-load benchmark's batch: how many output tokens/s
`EngineCore` does in this process, with no gateway, Batch API or peer beside it.

bench/mixed_load.py measures the batch through the server; this takes the same batch
requests (the same seeded lengths and prompt texts) and adds them all at once to an
`EngineCore` with the server's default scheduler settings, then steps until they are done,
recording each step. Steady state = the steps with at least 7/8 of `--max-num-seqs`
requests in the engine (before the queue drains). It answers whether a gap to a peer is the
engine's or the serving path's.

    .venv/bin/python bench/batch_engine.py                    # 200 requests, ~3 minutes
    .venv/bin/python bench/batch_engine.py --num-requests 40  # a quick check

Writes batch_engine.json and batch_engine.png into --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.batch import add_batch
from common.results import write_results
from tqdm import tqdm

from tokenfleet import LLM

RESULT_NAME = "batch_engine"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--num-requests", type=int, default=200, help="batch requests (default %(default)s)")
    add("--num-threads", type=int, default=1, help="torch threads (default %(default)s)")
    add("--dtype", default="float32", help="model dtype (default %(default)s)")
    add("--linear-backend", default="auto", choices=["auto", "torch", "onednn"])
    add("--max-model-len", type=int, default=2048, help="(default %(default)s)")
    add("--max-num-seqs", type=int, default=64, help="(default %(default)s)")
    add("--max-num-batched-tokens", type=int, default=512, help="(default %(default)s)")
    add("--prompt-len-median", type=int, default=128, help="(mixed_load's default)")
    add("--output-len-median", type=int, default=32, help="(mixed_load's default)")
    add("--length-tail", type=float, default=1.0, help="lognormal sigma (mixed_load's)")
    add("--seed", type=int, default=0)
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(
        num_threads=args.num_threads,
        overlap=False,  # steps one after another: each step's prediction and time its own
        dtype=args.dtype,
        linear_backend=args.linear_backend,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    _, specs, prompt_tokens = add_batch(
        llm,
        args.num_requests,
        max_model_len=args.max_model_len,
        prompt_len_median=args.prompt_len_median,
        output_len_median=args.output_len_median,
        length_tail=args.length_tail,
        seed=args.seed,
    )
    core = llm.engine
    steady_at = args.max_num_seqs * 7 // 8
    steps: list[dict[str, float]] = []
    started = time.perf_counter()
    total = sum(s.output_len for s in specs)
    with tqdm(total=total, desc="output tokens", unit="tok") as bar:
        while core.has_unfinished_requests():
            in_engine = len(core.scheduler.running) + len(core.scheduler.waiting)
            began = time.perf_counter()
            out = core.step()
            seconds = time.perf_counter() - began
            num_out = sum(len(o.new_token_ids) for o in out.outputs)
            bar.update(num_out)
            steps.append(
                {
                    "t_s": began - started,
                    "seconds": seconds,
                    "predicted_s": core.last_prediction or 0.0,
                    "in_engine": in_engine,
                    "output_tokens": num_out,
                }
            )
    wall = time.perf_counter() - started
    output_tokens = sum(s["output_tokens"] for s in steps)
    steady = [s for s in steps if s["in_engine"] >= steady_at]
    steady_s = sum(s["seconds"] for s in steady)
    return {
        "dtype": args.dtype,
        "linear_backend": core.runner.model.linear_backend,
        "num_requests": len(specs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "num_steps": len(steps),
        "wall_s": wall,
        "output_tokens_per_s": output_tokens / wall,
        "steady_min_in_engine": steady_at,
        "steady_steps": len(steady),
        "steady_output_tokens_per_s": (
            sum(s["output_tokens"] for s in steady) / steady_s if steady_s else None
        ),
        "steady_step_s_median": statistics.median(s["seconds"] for s in steady) if steady else None,
        "steady_measured_over_predicted": (
            steady_s / sum(s["predicted_s"] for s in steady) if steady else None
        ),
        "steps": steps,
    }


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    steps = result["steps"]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    ax = fig.subplots()
    ts = [s["t_s"] for s in steps]
    ax.plot(ts, [s["output_tokens"] / s["seconds"] for s in steps], lw=0.8, label="output tok/s")
    ax.set_xlabel("s since the first step")
    ax.set_ylabel("output tokens/s (per step)")
    other = ax.twinx()
    other.plot(ts, [s["in_engine"] for s in steps], color="tab:orange", lw=0.8)
    other.set_ylabel("requests in the engine", color="tab:orange")
    ax.set_title(
        f"engine alone, {result['num_requests']} batch requests: "
        f"{result['output_tokens_per_s']:.1f} tok/s overall, "
        f"{result['steady_output_tokens_per_s'] or float('nan'):.1f} at >= "
        f"{result['steady_min_in_engine']} in the engine"
    )
    ax.legend(loc="upper right")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    date = datetime.now(UTC).isoformat(timespec="seconds")
    result = run(args)
    print(
        f"{result['num_requests']} requests, {result['prompt_tokens']} prompt and "
        f"{result['output_tokens']} output tokens in {result['num_steps']} steps, "
        f"{result['wall_s']:.1f} s: {result['output_tokens_per_s']:.1f} output tok/s"
    )
    if result["steady_steps"]:
        print(
            f"steady (>= {result['steady_min_in_engine']} in the engine, "
            f"{result['steady_steps']} steps): {result['steady_output_tokens_per_s']:.1f} "
            f"tok/s, step median {result['steady_step_s_median']:.3f} s, measured / "
            f"predicted step time {result['steady_measured_over_predicted']:.2f}"
        )
    write_results(args, RESULT_NAME, date, result, lambda path: plot(path, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
