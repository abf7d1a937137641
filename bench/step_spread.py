"""The same forward, again and again: how far this machine spreads one step's time, and where
a whole-context prompt's one-token step sits against the TPOT target.

The long-prompt benchmark (bench/long_prompt.py) asks that the largest inter-token gap of
streams running beside a whole-context prompt stay within the TPOT target, twice the
single-stream decode step. Deep in that prompt every step carries at least one of its
tokens, whose attention reads the whole context, beside the streams' decodes. This takes
the bundled model's forward, in this process (no scheduler, gateway or sampling), on
fixed batches, rounds of every case taking turns (the order rotated), and reports each
case's median, p99 and largest time, against a target of twice the median of one decode:

- one decode at context 200 (the single-stream step: the target is 2x its median);
- three decodes at context 200 (the streams alone);
- three decodes and one query of a prompt at context C (`--contexts`), with the KV cache
  in each of `--kv-dtypes`: the cheapest step that moves a whole-context prompt on.

    .venv/bin/python bench/step_spread.py               # ~2 minutes on 2 cores
    .venv/bin/python bench/step_spread.py --rounds 10   # a quick check

Writes step_spread.json and step_spread.png into --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common.results import run_and_write
from common.stats import nearest_rank
from tqdm import tqdm

from tokenfleet import envs
from tokenfleet.checkpoint.bundled import prepare_bundled_model
from tokenfleet.models.attention import AttentionMetadata
from tokenfleet.models.loader import load_model
from tokenfleet.models.rope import rope_cos_sin

BLOCK = 16
STREAM_CONTEXT = 200  # each decode's context
STREAM_BLOCKS = 16  # blocks a decode's table holds (its context and a spare)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--rounds", type=int, default=200, help="timed rounds of every case (default %(default)s)")
    add("--contexts", type=int, nargs="+", default=[2000, 8000], help="the prompt's context")
    add("--kv-dtypes", nargs="+", default=["float32", "float16"], help="KV cache dtypes")
    add("--num-threads", type=int, default=1, help="torch threads (default %(default)s)")
    add("--out", type=Path, default=Path("bench/results"))
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    folder = prepare_bundled_model(envs.cache_dir() / "models", progress=False)
    model = load_model(folder, torch.device("cpu"), torch.float32)
    config, cpu = model.config, torch.device("cpu")
    longest = max(args.contexts) + 1
    prompt_blocks = (longest + BLOCK - 1) // BLOCK
    num_blocks = prompt_blocks + 3 * STREAM_BLOCKS
    cos, sin = rope_cos_sin(config, longest, cpu, torch.float32)
    streams = [
        list(range(prompt_blocks + i * STREAM_BLOCKS, prompt_blocks + (i + 1) * STREAM_BLOCKS))
        for i in range(3)
    ]

    def batch(decodes: int, context: int | None) -> tuple[Any, ...]:
        seqs = [(STREAM_CONTEXT, 1, streams[i]) for i in range(decodes)]
        positions = [STREAM_CONTEXT] * decodes
        if context is not None:  # one query of the prompt, after `context` tokens of it
            seqs.append((context, 1, list(range(context // BLOCK + 1))))
            positions.append(context)
        meta = AttentionMetadata.build(seqs, BLOCK, cpu)
        ids = torch.randint(0, config.vocab_size, (len(positions),))
        return ids, torch.tensor(positions), meta, torch.arange(decodes)

    # Random K/V (the softmax then spreads over the whole context, as a real one does).
    caches = {
        dtype: [
            torch.randn(2, num_blocks, BLOCK, config.num_kv_heads, config.head_dim).to(
                getattr(torch, dtype)
            )
            for _ in range(config.num_layers)
        ]
        for dtype in args.kv_dtypes
    }
    cases: list[tuple[str, str, tuple[Any, ...]]] = [
        ("1 decode", args.kv_dtypes[0], batch(1, None)),
        ("3 decodes", args.kv_dtypes[0], batch(3, None)),
    ]
    for dtype in args.kv_dtypes:
        for context in args.contexts:
            cases.append(
                (f"3 decodes + 1 query at {context}, {dtype} KV", dtype, batch(3, context))
            )
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    with torch.inference_mode():
        for r in tqdm(range(args.rounds + 1), desc="rounds", file=sys.stderr):
            for i in range(len(cases)):  # the order rotated round by round
                name, dtype, (ids, positions, meta, logits_rows) = cases[(i + r) % len(cases)]
                start = time.perf_counter()
                model(ids, cos[positions], sin[positions], caches[dtype], meta, logits_rows)
                if r:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
    target = 2 * statistics.median(times["1 decode"])
    rows = []
    for name, values in times.items():
        p50, top = statistics.median(values), max(values)
        row = {
            "case": name,
            "p50_s": p50,
            "p99_s": nearest_rank(values, 0.99),
            "max_s": top,
            "max_over_p50": top / p50,
            "p50_over_target": p50 / target,
            "max_over_target": top / target,
            "times_s": values,
        }
        rows.append(row)
        print(
            f"{name:40s} p50 {p50 * 1e3:6.1f}  p99 {row['p99_s'] * 1e3:6.1f}"
            f"  max {top * 1e3:6.1f} ms"
            f"  max/p50 {row['max_over_p50']:.2f}  p50/target {row['p50_over_target']:.2f}"
            f"  max/target {row['max_over_target']:.2f}",
            flush=True,
        )
    print(f"target (2 x the median of one decode): {target * 1e3:.1f} ms")
    return {"target_s": target, "cases": rows}


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    target_ms = result["target_s"] * 1e3
    cases = result["cases"]
    left.boxplot([[t * 1e3 for t in c["times_s"]] for c in cases], vert=False, whis=(0, 100))
    left.set_yticks(range(1, len(cases) + 1), [c["case"] for c in cases], fontsize="small")
    left.axvline(target_ms, color="red", linestyle="--", label=f"target {target_ms:.1f} ms")
    left.set(xlabel="forward, ms (whiskers: min and max)")
    left.legend(fontsize="small")
    left.set_title("each case's spread")
    for c in cases:
        right.plot(
            [t * 1e3 for t in c["times_s"]], ".-", markersize=3, linewidth=0.5, label=c["case"]
        )
    right.axhline(target_ms, color="red", linestyle="--")
    right.set(xlabel="round", ylabel="ms")
    right.legend(fontsize="x-small")
    right.set_title("round by round (the machine's spells)")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    run_and_write(parse_args(argv), "step_spread", run, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
