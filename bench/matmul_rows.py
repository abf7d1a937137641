"""How fast this CPU multiplies a few rows by the bundled model's weights: the rate of each
product of a decoder layer and of the logits, at 1 to 64 rows (the rows of a step: decodes
and prompt tokens), in float32 and bfloat16, the logits in blocks of the vocabulary
(`LlamaForCausalLM.vocab_logits` without oneDNN), and float32 through oneDNN's packed weights
(models/packed.py, what the engine uses where a timing at load finds it faster than torch's
BLAS). It says what a batch token beside a stream costs, and which way the engine should
take.

Weights are the model's shapes filled at random; each product is timed `--repeats` times
after a warm-up and the median kept. The layer weights (14 MB a layer) stay in the CPU's
caches here, so the layer rates are compute rates; the logits weight (113 MB) does not.

    .venv/bin/python bench/matmul_rows.py          # ~1 minute

Writes matmul_rows.json and matmul_rows.png into --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common.results import run_and_write
from common.timing import timed

from tokenfleet.models import packed
from tokenfleet.models.llama import VOCAB_BLOCK, vocab_blocks

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads and 3 KV heads of 64, vocab 49152.
SHAPES = {
    "qkv": (576, 576 + 2 * 192),
    "o": (576, 576),
    "gate_up": (576, 2 * 1536),
    "down": (1536, 576),
    "logits": (576, 49152),
}
ROWS = (1, 2, 3, 4, 8, 16, 32, 64)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for name, (fan_in, fan_out) in SHAPES.items():
            weight = torch.randn(fan_out, fan_in)
            weight16 = weight.to(torch.bfloat16)
            weight_packed = packed.pack(weight) if packed.available() else None
            for m in ROWS:
                h = torch.randn(m, fan_in)
                h16 = h.to(torch.bfloat16)
                flops = 2 * m * weight.numel()
                repeats = args.repeats if name != "logits" else max(3, args.repeats // 3)
                row = {
                    "product": name,
                    "rows": m,
                    "float32_s": timed(lambda h=h, w=weight: F.linear(h, w), repeats),
                    "bfloat16_s": timed(lambda h=h16, w=weight16: F.linear(h, w), repeats),
                }
                if weight_packed is not None:
                    row["float32_onednn_s"] = timed(
                        lambda h=h, w=weight_packed: packed.packed_linear(h, w, None), repeats
                    )
                if name == "logits":
                    row["float32_blocks_s"] = timed(
                        lambda h=h, w=weight: vocab_blocks(h, w), repeats
                    )
                for key in [k for k in row if k.endswith("_s")]:
                    row[key.replace("_s", "_gflops")] = flops / row[key] / 1e9
                rows.append(row)
                print(
                    f"{name:8s} {m:3d} rows: float32 {row['float32_s'] * 1e3:7.2f} ms "
                    f"({row['float32_gflops']:5.1f} GFLOP/s), bfloat16 "
                    f"{row['bfloat16_s'] * 1e3:7.2f} ms"
                    + (
                        f", float32 oneDNN {row['float32_onednn_s'] * 1e3:7.2f} ms "
                        f"({row['float32_onednn_gflops']:5.1f} GFLOP/s)"
                        if "float32_onednn_s" in row
                        else ""
                    )
                    + (
                        f", float32 in blocks {row['float32_blocks_s'] * 1e3:7.2f} ms"
                        if "float32_blocks_s" in row
                        else ""
                    ),
                    flush=True,
                )
    return {"rows": rows}


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, name in enumerate(SHAPES):
        chosen = [r for r in result["rows"] if r["product"] == name]
        if name != "logits":
            ms = [r["rows"] for r in chosen]
            color = f"C{i}"
            left.plot(ms, [r["float32_gflops"] for r in chosen], "o-", color=color, label=name)
            if "float32_onednn_gflops" in chosen[0]:
                left.plot(
                    ms,
                    [r["float32_onednn_gflops"] for r in chosen],
                    "s--",
                    color=color,
                    label=f"{name}, oneDNN",
                )
    left.set_xscale("log", base=2)
    left.set_xlabel("rows")
    left.set_ylabel("float32 GFLOP/s (layer products; dashed: oneDNN)")
    left.legend(fontsize="small", ncol=2)
    logits = [r for r in result["rows"] if r["product"] == "logits"]
    ms = [r["rows"] for r in logits]
    for key, label in (
        ("float32_s", "float32, one product"),
        ("float32_blocks_s", f"float32, blocks of {VOCAB_BLOCK}"),
        ("float32_onednn_s", "float32, oneDNN packed"),
        ("bfloat16_s", "bfloat16"),
    ):
        if key in logits[0]:
            right.plot(ms, [r[key] * 1e3 for r in logits], "o-", label=label)
    right.set_xscale("log", base=2)
    right.set_xlabel("rows")
    right.set_ylabel("logits product, ms")
    right.legend()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    run_and_write(parse_args(argv), "matmul_rows", run, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
