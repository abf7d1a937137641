"""Attention over the paged KV cache, one step's worth: the engine's C kernel
(kernels/paged_attention.c) against the torch path (gather the blocks, then
scaled_dot_product_attention) and against the memory-bound floor, for a decode or a short
chunk at the end of a long context.

Each of `--layers` layers has its own cache tensors, as in the model, so that a step reads
its K/V from memory and not from a cache one layer left warm; the sequence's blocks are a
random pick of a pool twice its size (a paged cache's scattered blocks). A row times
`PagedAttention.forward` (the new K/V written, then attention) over all layers, the two
ways taking turns repeat by repeat; figures are medians. The floor is the bytes of K/V a
step reads over this core's streaming rate, measured in the same run (a sum over a
512 MB tensor, one thread).

    .venv/bin/python bench/attention_kernel.py                       # ~2 minutes
    .venv/bin/python bench/attention_kernel.py --contexts 8000 --queries 1 4

Writes attention_kernel.json and attention_kernel.png into --out. The defaults are the
bundled model's shape (30 layers, 9 query heads and 3 KV heads of 64, blocks of 16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from common.results import run_and_write

from tokenfleet.kernels import paged_attention_lib
from tokenfleet.models.attention import KERNEL_MAX_QUERY, AttentionMetadata, PagedAttention
from tokenfleet.models.packed import best_time

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--contexts", type=int, nargs="+", default=[500, 2000, 4000, 8000])
    add("--queries", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="query tokens")
    add("--kv-dtypes", nargs="+", default=["float32", "float16"], choices=sorted(DTYPES))
    add("--layers", type=int, default=30)
    add("--heads", type=int, default=9)
    add("--kv-heads", type=int, default=3)
    add("--head-dim", type=int, default=64)
    add("--block-size", type=int, default=16)
    add("--repeats", type=int, default=7)
    add("--num-threads", type=int, default=1)
    add("--seed", type=int, default=0)
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if any(q < 1 or q > KERNEL_MAX_QUERY for q in args.queries):
        parser.error(f"--queries must be in [1, {KERNEL_MAX_QUERY}] (the kernel's chunks)")
    if any(c < max(args.queries) for c in args.contexts):
        parser.error("every context must hold the largest chunk")
    return args


def streaming_rate(repeats: int = 3) -> float:
    """Bytes per second one thread reads, summing a 512 MB tensor (the best of `repeats`)."""
    x = torch.ones(128 << 20)
    x.sum()
    return x.numel() * x.element_size() / best_time(x.sum, repeats)


def measure(args: argparse.Namespace, kv_dtype: str, context: int, queries: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed)
    bs, hkv, d, heads = args.block_size, args.kv_heads, args.head_dim, args.heads
    num_blocks = -(context // -bs)
    pool = 2 * num_blocks
    dtype = DTYPES[kv_dtype]
    caches = [torch.randn(2, pool, bs, hkv, d, generator=gen).to(dtype) for _ in range(args.layers)]
    block_ids = torch.randperm(pool, generator=gen)[:num_blocks].tolist()
    meta = AttentionMetadata.build(
        [(context - queries, queries, block_ids)], bs, torch.device("cpu")
    )
    q = torch.randn(queries, heads, d, generator=gen)
    k = torch.randn(queries, hkv, d, generator=gen)
    v = torch.randn(queries, hkv, d, generator=gen)
    ways = {
        "kernel": PagedAttention(heads, hkv, d, use_kernel=True),
        "torch": PagedAttention(heads, hkv, d, use_kernel=False),
    }

    def step(attn: PagedAttention) -> torch.Tensor:
        out = q
        for cache in caches:
            out = attn.forward(q, k, v, cache[0], cache[1], meta)
        return out

    with torch.inference_mode():
        torch.testing.assert_close(
            step(ways["kernel"]), step(ways["torch"]), atol=2e-5, rtol=1e-4
        )  # the same attention both ways (the last layer's)
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way, attn in ways.items():
                times[way].append(best_time(lambda attn=attn: step(attn), 1))
    kv_bytes = args.layers * 2 * context * hkv * d * caches[0].element_size()
    return {
        "kv_dtype": kv_dtype,
        "context": context,
        "queries": queries,
        "kernel_s": statistics.median(times["kernel"]),
        "torch_s": statistics.median(times["torch"]),
        "kv_bytes": kv_bytes,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.num_threads)
    if paged_attention_lib() is None:
        raise SystemExit("the C kernel did not build here (is a C compiler installed?)")
    rate = streaming_rate()
    print(f"streaming rate, one thread: {rate / 1e9:.1f} GB/s", flush=True)
    rows = []
    print(
        f"{'kv':>8} {'context':>7} {'q':>3} {'kernel ms':>10} {'torch ms':>9} "
        f"{'floor ms':>9} {'kernel/floor':>12} {'torch/kernel':>12}"
    )
    for kv_dtype in args.kv_dtypes:
        for context in args.contexts:
            for queries in args.queries:
                row = measure(args, kv_dtype, context, queries)
                row["floor_s"] = row["kv_bytes"] / rate
                rows.append(row)
                print(
                    f"{kv_dtype:>8} {context:7d} {queries:3d} {row['kernel_s'] * 1e3:10.1f} "
                    f"{row['torch_s'] * 1e3:9.1f} {row['floor_s'] * 1e3:9.1f} "
                    f"{row['kernel_s'] / row['floor_s']:12.2f} "
                    f"{row['torch_s'] / row['kernel_s']:12.2f}",
                    flush=True,
                )
    return {"streaming_bytes_per_s": rate, "torch": torch.__version__, "rows": rows}


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    rows = result["rows"]
    dtypes = list(dict.fromkeys(r["kv_dtype"] for r in rows))
    fig = Figure(figsize=(6 * len(dtypes), 4.5), layout="constrained")
    axes = fig.subplots(1, len(dtypes), squeeze=False)[0]
    for ax, kv_dtype in zip(axes, dtypes, strict=True):
        mine = [r for r in rows if r["kv_dtype"] == kv_dtype]
        for queries in sorted({r["queries"] for r in mine}):
            line = [r for r in mine if r["queries"] == queries]
            ctx = [r["context"] for r in line]
            (drawn,) = ax.plot(
                ctx, [r["kernel_s"] * 1e3 for r in line], "o-", label=f"kernel, {queries} q"
            )
            ax.plot(ctx, [r["torch_s"] * 1e3 for r in line], "x--", color=drawn.get_color(), lw=0.8)
        floor = [r for r in mine if r["queries"] == mine[0]["queries"]]
        ax.plot(
            [r["context"] for r in floor],
            [r["floor_s"] * 1e3 for r in floor],
            "k:",
            label="memory floor",
        )
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("attention, all layers, ms (median)")
        ax.set_title(f"{kv_dtype} KV: kernel (solid) vs gather + SDPA (dashed)")
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    run_and_write(parse_args(argv), "attention_kernel", run, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
