"""What admission's TTFT prediction (policy/admission.py's predict_ttft) costs the gateway's
event loop: microseconds per call, median and p90, on queues of 0/10/60/250 running decodes
x 0/10/40 interactive prompts waiting for their first token, under the priority policy
(60% of the decodes interactive streams, 40% batch, batch in flight) and fcfs.

Each call is what AdmissionControl.predict makes for a new interactive prompt: the
engine's default priority settings (TPOT target 60 ms, margin 0.1, floor 16 tokens), a
GPU-like step-time model, 2,048 tokens a step, 512 sequences, a TTFT target of 2 s (the
replay stops once over it). Decodes read 1,000 tokens of context each; prompts are 512
tokens. The tree on PYTHONPATH is the one measured (an older checkout works too: only the
arguments its predict_ttft takes are passed).

    .venv/bin/python bench/admission_cost.py --out /tmp/cost
    PYTHONPATH=/tmp/old .venv/bin/python bench/admission_cost.py --out /tmp/cost-old

Writes admission_cost.json and admission_cost.png into --out (bench/results; there too
admission_cost_before.*: the same run before the decodes were folded, at commit f4f01ad).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tokenfleet.policy import admission
from tokenfleet.policy.admission import Decodes, StepLimit

# A GPU-like fit: 12 ms a step, 25k prefill tokens/s, 0.2 ms a decode, KV reads, attention.
COEFFICIENTS = {
    "intercept": 0.012,
    "prefill_tokens": 4e-5,
    "decode_seqs": 2e-4,
    "kv_tokens_read": 3e-7,
    "prefill_attention": 2e-10,
}
TPOT_TARGET_S, MARGIN, MIN_PREFILL_CHUNK = 0.06, 0.1, 16
TTFT_TARGET_S = 2.0
MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, BLOCK_SIZE = 2048, 512, 16
CONTEXT, PROMPT = 1000, 512
RUNNING = (0, 10, 60, 250)
WAITING = (0, 10, 40)
POLICIES = ("priority", "fcfs")


def call(policy: str, running: int, waiting: int) -> Any:
    """A predict_ttft call as AdmissionControl makes it, as a thunk."""
    limit = None
    if policy == "priority":
        limit = StepLimit(TPOT_TARGET_S * (1 - MARGIN), MIN_PREFILL_CHUNK, TPOT_TARGET_S)
    streams = running * 3 // 5 if policy == "priority" else running // 2
    batch = running - streams
    kwargs: dict[str, Any] = {"stop_over": TTFT_TARGET_S}
    accepted = inspect.signature(admission.predict_ttft).parameters
    for name, value in (("max_num_seqs", MAX_NUM_SEQS), ("block_size", BLOCK_SIZE)):
        if name in accepted:
            kwargs[name] = value
    args = (
        COEFFICIENTS,
        MAX_NUM_BATCHED_TOKENS,
        PROMPT,
        [PROMPT] * waiting,
        Decodes(streams, streams * CONTEXT),
        Decodes(batch, batch * CONTEXT),
        limit,
        batch > 0,
        COEFFICIENTS,
        0,
    )
    return lambda: admission.predict_ttft(*args, **kwargs)


def measure(thunk: Any, min_calls: int, min_seconds: float) -> tuple[float, float, float]:
    """(median, p90) microseconds per call, and the prediction."""
    predicted = thunk()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - began < min_seconds:
        t0 = time.perf_counter()
        thunk()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))], predicted


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(POLICIES), figsize=(11, 4), sharey=True)
    for ax, policy in zip(axes, POLICIES, strict=True):
        for waiting in WAITING:
            points = [r for r in rows if r["policy"] == policy and r["waiting"] == waiting]
            ax.plot(
                [r["running"] for r in points],
                [r["median_us"] for r in points],
                marker="o",
                label=f"{waiting} waiting",
            )
        ax.set_title(policy)
        ax.set_xlabel("running decodes")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("predict_ttft, median µs per call")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--min-calls", type=int, default=30, help="calls per cell, at least")
    parser.add_argument("--min-seconds", type=float, default=0.3, help="time per cell, at least")
    args = parser.parse_args()
    rows = []
    for policy in POLICIES:
        for running in RUNNING:
            for waiting in WAITING:
                median, p90, predicted = measure(
                    call(policy, running, waiting), args.min_calls, args.min_seconds
                )
                rows.append(
                    {
                        "policy": policy,
                        "running": running,
                        "waiting": waiting,
                        "median_us": median,
                        "p90_us": p90,
                        "predicted_ttft_s": predicted,
                    }
                )
    print(f"{'policy':<9}{'running':>8}{'waiting':>8}{'median µs':>11}{'p90 µs':>10}{'TTFT s':>10}")
    for r in rows:
        print(
            f"{r['policy']:<9}{r['running']:>8}{r['waiting']:>8}"
            f"{r['median_us']:>11.0f}{r['p90_us']:>10.0f}{r['predicted_ttft_s']:>10.4f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "argv": sys.argv,
        "module": admission.__file__,
        "settings": {
            "coefficients": COEFFICIENTS,
            "tpot_target_s": TPOT_TARGET_S,
            "margin": MARGIN,
            "min_prefill_chunk": MIN_PREFILL_CHUNK,
            "ttft_target_s": TTFT_TARGET_S,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_num_seqs": MAX_NUM_SEQS,
            "context": CONTEXT,
            "prompt": PROMPT,
        },
        "rows": rows,
    }
    (args.out / "admission_cost.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out / "admission_cost.png")
    print(f"wrote {args.out}/admission_cost.json and .png")


if __name__ == "__main__":
    main()
