"""What a step spends outside the linear layers, part against part: sampling at
temperature 1 (the engine's inverse CDF against the exponential race it replaced, and
greedy argmax as the floor), the decoder layer's residual add + RMS norm and rotary
embedding (the C kernels of kernels/elementwise.c against the torch expressions), and the
bundled model's whole forward with the fused kernels and without, at the row counts of
decode and mixed steps.

Every figure is the median of `--repeats` timings after a warm-up; the forward's two ways
take turns, so that a slow spell of the machine falls on both alike.

    .venv/bin/python bench/step_parts.py           # ~2 minutes

Writes step_parts.json and step_parts.png into --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common.results import run_and_write
from common.timing import timed

from tokenfleet import envs, kernels
from tokenfleet.checkpoint.bundled import prepare_bundled_model
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.models.attention import AttentionMetadata
from tokenfleet.models.loader import load_model
from tokenfleet.models.rope import apply_rope, rope_cos_sin
from tokenfleet.runner.sampler import sample

SAMPLE_ROWS = (1, 4, 16, 64)
ELEMENTWISE_ROWS = (1, 16, 64, 512)
DECODE_ROWS = (1, 16, 64)  # decodes in a step
CHUNK_ROWS = (16, 64, 256)  # a prompt chunk's tokens
CONTEXT = 256  # each decode's context in the forward's decode steps
BLOCK = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    return parser.parse_args(argv)


def exponential_race(logits: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """The sampler before commit 3b2df82: a vocabulary of Exp(1) draws per row, then
    argmax(p / E), which draws from p."""
    probs = logits.softmax(dim=-1)
    tokens = []
    for j, gen in enumerate(generators):
        noise = torch.empty_like(probs[j]).exponential_(generator=gen)
        tokens.append(int((probs[j] / noise).argmax()))
    return tokens


def sampling(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    rows = []
    for m in SAMPLE_ROWS:
        logits = torch.randn(m, vocab, generator=torch.Generator().manual_seed(m))
        gens = [torch.Generator().manual_seed(i) for i in range(m)]
        hot = [SamplingParams(temperature=1.0)] * m
        row = {
            "rows": m,
            "inverse_cdf_s": timed(lambda: sample(logits, hot, gens), args.repeats),  # noqa: B023
            "exponential_race_s": timed(lambda: exponential_race(logits, gens), args.repeats),  # noqa: B023
            "greedy_s": timed(lambda: logits.argmax(dim=-1).tolist(), args.repeats),  # noqa: B023
        }
        rows.append(row)
        print(
            f"sampling {m:3d} rows: inverse CDF {row['inverse_cdf_s'] * 1e3:6.2f} ms, "
            f"exponential race {row['exponential_race_s'] * 1e3:6.2f} ms, greedy "
            f"{row['greedy_s'] * 1e3:6.2f} ms",
            flush=True,
        )
    return rows


def elementwise(
    args: argparse.Namespace, hidden: int, heads: int, kv_heads: int, head_dim: int
) -> list[dict[str, Any]]:
    rows = []
    eps = 1e-5
    weight = torch.randn(hidden)
    width = (heads + 2 * kv_heads) * head_dim
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    for m in ELEMENTWISE_ROWS:
        x, residual = torch.randn(m, hidden), torch.randn(m, hidden)
        qkv = torch.randn(m, width)
        cos, sin = torch.randn(m, head_dim), torch.randn(m, head_dim)

        def torch_norm() -> None:
            s = x + residual  # noqa: B023
            weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))

        def torch_rope() -> None:
            apply_rope(qkv[:, :q_size].view(m, heads, head_dim), cos, sin)  # noqa: B023
            apply_rope(qkv[:, q_size : q_size + kv_size].view(m, kv_heads, head_dim), cos, sin)  # noqa: B023

        row = {
            "rows": m,
            "add_norm_torch_s": timed(torch_norm, args.repeats * 5),
            "add_norm_kernel_s": timed(
                lambda: kernels.add_rms_norm(x, residual, weight, eps),  # noqa: B023 (x grows: harmless)
                args.repeats * 5,
            ),
            "rope_torch_s": timed(torch_rope, args.repeats * 5),
            "rope_kernel_s": timed(
                lambda: kernels.rope_(qkv, cos, sin, heads + kv_heads, head_dim),  # noqa: B023
                args.repeats * 5,
            ),
        }
        rows.append(row)
        print(
            f"element-wise {m:3d} rows: add+norm torch {row['add_norm_torch_s'] * 1e6:7.1f} us, "
            f"kernel {row['add_norm_kernel_s'] * 1e6:7.1f} us; rope torch "
            f"{row['rope_torch_s'] * 1e6:7.1f} us, kernel {row['rope_kernel_s'] * 1e6:7.1f} us",
            flush=True,
        )
    return rows


def forward(args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = prepare_bundled_model(envs.cache_dir() / "models", progress=False)
    model = load_model(folder, torch.device("cpu"), torch.float32)
    config = model.config
    blocks_per_seq = (CONTEXT + BLOCK) // BLOCK
    caches = [
        torch.zeros(
            2, max(DECODE_ROWS) * blocks_per_seq, BLOCK, config.num_kv_heads, config.head_dim
        )
        for _ in range(config.num_layers)
    ]
    cos, sin = rope_cos_sin(config, CONTEXT + max(CHUNK_ROWS), torch.device("cpu"), torch.float32)
    cpu = torch.device("cpu")
    rows = []
    for m in sorted(set(DECODE_ROWS) | set(CHUNK_ROWS)):
        ids = torch.randint(0, config.vocab_size, (m,), generator=torch.Generator().manual_seed(m))
        cases = []
        if m in DECODE_ROWS:  # m decodes at context CONTEXT, each with blocks of its own
            tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(m)]
            meta = AttentionMetadata.build([(CONTEXT, 1, t) for t in tables], BLOCK, cpu)
            cases.append(("decodes", meta, torch.full((m,), CONTEXT), torch.arange(m)))
        if m in CHUNK_ROWS:  # a prompt's m tokens after CONTEXT of its own
            blocks = list(range((CONTEXT + m + BLOCK - 1) // BLOCK))
            meta = AttentionMetadata.build([(CONTEXT, m, blocks)], BLOCK, cpu)
            cases.append(("chunk", meta, torch.arange(CONTEXT, CONTEXT + m), torch.tensor([m - 1])))
        row: dict[str, Any] = {"rows": m}
        for kind, meta, pos, logits_rows in cases:
            times: dict[bool, list[float]] = {True: [], False: []}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for fused in (True, False):
                    model.use_fused(fused)
                    start = time.perf_counter()
                    model(ids, cos[pos], sin[pos], caches, meta, logits_rows)
                    if repeat:
                        times[fused].append(time.perf_counter() - start)
            row[f"{kind}_fused_s"] = sorted(times[True])[args.repeats // 2]
            row[f"{kind}_torch_s"] = sorted(times[False])[args.repeats // 2]
            print(
                f"forward, {kind} of {m:3d} rows: fused {row[f'{kind}_fused_s'] * 1e3:7.1f} ms, "
                f"torch {row[f'{kind}_torch_s'] * 1e3:7.1f} ms",
                flush=True,
            )
        rows.append(row)
    model.use_fused(True)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    if kernels.elementwise_lib() is None:
        raise SystemExit("the element-wise kernels cannot be built here (no C compiler)")
    with torch.inference_mode():
        result = {
            "sampling": sampling(args, 49152),
            "elementwise": elementwise(args, 576, 9, 3, 64),
            "forward": forward(args),
        }
    return result


def _panel(
    ax: Any, rows: list[dict[str, Any]], series: tuple[tuple[str, str], ...], scale: float
) -> None:
    """One line per (key, label) over the rows that have the key; the torch and earlier
    ways dashed."""
    for key, label in series:
        chosen = [r for r in rows if key in r]
        style = "s--" if "torch" in key or "race" in key else "o-"
        ax.plot([r["rows"] for r in chosen], [r[key] * scale for r in chosen], style, label=label)
    ax.legend(fontsize="small")


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 4.5), layout="constrained")
    left, middle, right = fig.subplots(1, 3)
    sampling_series = (
        ("exponential_race_s", "exponential race (before)"),
        ("inverse_cdf_s", "inverse CDF (sample())"),
        ("greedy_s", "greedy argmax"),
    )
    _panel(left, result["sampling"], sampling_series, 1e3)
    left.set(xscale="log", yscale="log", xlabel="rows at temperature 1", ylabel="ms")
    left.set_title("sampling, vocabulary 49,152")
    elementwise_series = (
        ("add_norm_torch_s", "add + RMS norm, torch"),
        ("add_norm_kernel_s", "add + RMS norm, kernel"),
        ("rope_torch_s", "rope q and k, torch"),
        ("rope_kernel_s", "rope q and k, kernel"),
    )
    _panel(middle, result["elementwise"], elementwise_series, 1e6)
    middle.set(xscale="log", yscale="log", xlabel="rows", ylabel="us per layer call")
    middle.set_title("a decoder layer's element-wise parts")
    forward_series = (
        ("decodes_torch_s", "decodes, torch"),
        ("decodes_fused_s", "decodes, fused"),
        ("chunk_torch_s", "prompt chunk, torch"),
        ("chunk_fused_s", "prompt chunk, fused"),
    )
    _panel(right, result["forward"], forward_series, 1e3)
    right.set(xscale="log", yscale="log", xlabel="rows", ylabel="ms")
    right.set_title(f"the model's forward (context {CONTEXT})")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    run_and_write(parse_args(argv), "step_parts", run, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
