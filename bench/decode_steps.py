"""Decode step time by the number of sequences, the engine's logits against one plain
product: `EngineCore` in this process, N requests of `--prompt-len`-token prompts decoding
together, and the two ways of computing the logits taking turns step by step (the engine's
`LlamaForCausalLM.vocab_logits`: blocks of the vocabulary, one row through a transposed
copy where the load-time timing kept it; against `lm_head(h)`, one product), so that a slow
spell of the machine falls on both alike. Figures: the median of each way's decode steps
(every request decoding one token, none prefilling) at each N.

    .venv/bin/python bench/decode_steps.py          # ~3 minutes

Writes decode_steps.json and decode_steps.png into --out.
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

from tokenfleet import LLM, SamplingParams
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.models.llama import LlamaForCausalLM

WAYS = {
    "engine": LlamaForCausalLM.vocab_logits,
    "one_product": lambda self, h: self.lm_head(h),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--seqs", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32])
    add("--prompt-len", type=int, default=300)
    add("--decode-tokens", type=int, default=60, help="tokens each request decodes")
    add("--num-threads", type=int, default=1)
    add("--out", type=Path, default=Path("bench/results"))
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Steps one after another (no overlap): each step's time is its own.
    llm = LLM(num_threads=args.num_threads, max_model_len=2048, max_num_seqs=64, overlap=False)
    core = llm.engine
    model = core.runner.model
    rows = []
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    try:
        for n in args.seqs:
            for i in range(n):
                prompt = [100 + (i * 7 + j) % 30000 for j in range(args.prompt_len)]
                core.add_request(
                    EngineCoreRequest(f"r{n}-{i}", prompt, params, time.monotonic(), 1)
                )
            times: dict[str, list[float]] = {way: [] for way in WAYS}
            turn = 0
            while core.has_unfinished_requests():
                way = list(WAYS)[turn % len(WAYS)]
                turn += 1
                LlamaForCausalLM.vocab_logits = WAYS[way]  # type: ignore[method-assign]
                start = time.perf_counter()
                out = core.step()
                seconds = time.perf_counter() - start
                decoding = len(out.outputs) == n and len(core.scheduler.running) == n
                if decoding and all(len(o.new_token_ids) == 1 for o in out.outputs):
                    times[way].append(seconds)
            row: dict[str, Any] = {"seqs": n}
            for way, values in times.items():
                row[f"{way}_s"] = statistics.median(values)
                row[f"{way}_steps"] = len(values)
            rows.append(row)
            print(
                f"{n:3d} sequences: engine {row['engine_s'] * 1e3:6.1f} ms, one product "
                f"{row['one_product_s'] * 1e3:6.1f} ms",
                flush=True,
            )
    finally:
        LlamaForCausalLM.vocab_logits = WAYS["engine"]  # type: ignore[method-assign]
    return {
        "transposed_copy_kept": model._weight_t is not None,
        "torch": torch.__version__,
        "rows": rows,
    }


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    seqs = [r["seqs"] for r in result["rows"]]
    for way, label in (
        ("engine", "engine (blocks / transposed row)"),
        ("one_product", "one product"),
    ):
        ax.plot(seqs, [r[f"{way}_s"] * 1e3 for r in result["rows"]], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences decoding")
    ax.set_ylabel("decode step, ms (median)")
    ax.legend()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    run_and_write(parse_args(argv), "decode_steps", run, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
