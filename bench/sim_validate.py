"""Simulator validation: the simulator, costed by the step-time model the engine fitted on
this CPU, against the measured engine on the same arrivals.

1. The real EngineCore (bundled SmolLM2-135M on the CPU; `--runner fixed` swaps the model
   for the fixed-token runner, for a smoke run of the plumbing) serves Poisson arrivals
   in real time: each request's TTFT and TPOT, and output tokens per second, are
   measured at the engine's step loop.
2. The engine's step-time model, as it stands after the run (start-up profile plus online
   refit on this CPU), becomes the simulator's cost model (LinearStepCost).
3. The simulator replays the same arrivals (a trace: same times, lengths and shared
   prefixes) on one replica with the engine's scheduler settings and KV blocks.

Reported side by side: TTFT and TPOT p50/p99 and output tokens/s, measured and
simulated, and their ratio (simulated / measured). The cost model prices only the
runner's time; the engine's own per-step work (scheduling, update) is not in it, so the
simulator is expected to be somewhat fast; the ratio says how much.

    .venv/bin/python bench/sim_validate.py                         # ~2 min, the real model
    .venv/bin/python bench/sim_validate.py --runner fixed --num-requests 20   # smoke

Writes sim_validate.json and sim_validate.png into --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from tokenfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.engine.core import EngineCore
from tokenfleet.loadgen.report import percentile
from tokenfleet.sim.config import parse_config
from tokenfleet.sim.run import simulate
from tokenfleet.sim.trace import write_trace
from tokenfleet.sim.workload import (
    Arrival,
    InteractiveWorkload,
    Lengths,
    SharedPrompts,
    interactive_arrivals,
)


def arrivals(args: argparse.Namespace) -> list[Arrival]:
    workload = InteractiveWorkload(
        peak_rate=args.rate,
        daily_curve=(1.0,),
        lengths=Lengths(
            prompt_median=args.prompt_median,
            output_median=args.output_median,
            max_prompt_len=args.max_model_len // 2,
            max_model_len=args.max_model_len,
        ),
        prompts=SharedPrompts(count=2, length=64, share=0.5),
    )
    stream = interactive_arrivals(workload, 1e9, seed=args.seed)
    return [next(stream) for _ in range(args.num_requests)]


def engine_prompt(arrival: Arrival, vocab_size: int, seed: int) -> list[int]:
    """Token ids for the real engine with the sim's structure: a shared prefix per
    prefix_id, then ids of the request's own (random, so no other request shares them)."""
    shared = random.Random(f"{seed}:prefix:{arrival.prefix_id}")
    own = random.Random(f"{seed}:own:{arrival.index}")
    num_shared = min(arrival.prefix_len, arrival.prompt_len) if arrival.prefix_id >= 0 else 0
    ids = [shared.randrange(100, vocab_size) for _ in range(num_shared)]
    return ids + [own.randrange(100, vocab_size) for _ in range(arrival.prompt_len - num_shared)]


def measure(engine: EngineCore, requests: list[Arrival], seed: int) -> dict[str, Any]:
    """Serve the arrivals in real time; per request (ttft, tpot) and tokens/s."""
    vocab = engine.model_config.vocab_size
    pending = sorted(requests, key=lambda a: a.arrival_s)
    first: dict[str, float] = {}
    ttft, tpot = [], []
    start = time.monotonic()
    num_tokens = 0
    done = 0
    while done < len(requests):
        now = time.monotonic() - start
        while pending and pending[0].arrival_s <= now:
            a = pending.pop(0)
            engine.add_request(
                EngineCoreRequest(
                    a.req_id,
                    engine_prompt(a, vocab, seed),
                    SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0),
                    arrival_time=start + a.arrival_s,
                )
            )
        if not engine.has_unfinished_requests():
            time.sleep(min(0.001, max(0.0, pending[0].arrival_s - now)) if pending else 0)
            continue
        outputs = engine.step().outputs
        t = time.monotonic() - start
        by_id = {a.req_id: a for a in requests}
        for o in outputs:
            num_tokens += len(o.new_token_ids)
            first.setdefault(o.req_id, t)
            if o.finished:
                a = by_id[o.req_id]
                ttft.append(first[o.req_id] - a.arrival_s)
                tpot.append((t - first[o.req_id]) / max(a.output_len - 1, 1))
                done += 1
    span = time.monotonic() - start
    return summary(ttft, tpot, num_tokens / span)


def summary(ttft: list[float], tpot: list[float], tokens_per_s: float) -> dict[str, Any]:
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "output_tokens_per_s": tokens_per_s,
    }


def simulated(
    engine: EngineCore, requests: list[Arrival], args: argparse.Namespace
) -> dict[str, Any]:
    coefficients = args.out / "fitted_coefficients.json"
    coefficients.write_text(json.dumps({"coefficients": engine.step_model.coefficients}))
    trace = args.out / "arrivals.jsonl"
    write_trace(trace, [(a, None) for a in requests])
    sched = engine.scheduler.config
    config = parse_config(
        {
            "duration_s": 1e6,
            "cost": {"coefficients": str(coefficients)},
            "trace": str(trace),
            "replica": {
                "num_kv_blocks": engine.kv.pool.num_blocks,
                "block_size": engine.kv.block_size,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_num_seqs": sched.max_num_seqs,
                "max_model_len": sched.max_model_len,
                "tpot_target_s": engine.config.tpot_target_s,
                "harvest_margin": engine.config.harvest_margin,
            },
            "policies": [{"name": "priority", "replicas": 1}],
            "sample_s": 1e5,
        }
    )
    metrics = simulate(config, config.policies[0]).metrics
    log = metrics.classes["interactive"]
    tokens_per_s = log.output_tokens / metrics.last_finish_s  # from time 0, as measured
    return summary(list(log.ttft_s), list(log.tpot_s), tokens_per_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runner", choices=("model", "fixed"), default="model")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--prompt-median", type=int, default=128)
    parser.add_argument("--output-median", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine = EngineCore(
        EngineConfig(
            runner=args.runner,
            overlap=False,  # as the simulator steps: planned after the previous step
            max_model_len=args.max_model_len,
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32),
            cache=CacheConfig(kv_cache_memory=64 * 2**20),
        )
    )
    requests = arrivals(args)
    measured = measure(engine, requests, args.seed)
    sim = simulated(engine, requests, args)
    rows = {k: (measured[k], sim[k]) for k in measured}
    print(f"{'metric':<22}{'measured':>12}{'simulated':>12}{'sim/meas':>10}")
    for k, (m, s) in rows.items():
        ratio = s / m if m and s is not None else None
        print(f"{k:<22}{m or 0:>12.4g}{s or 0:>12.4g}{'' if ratio is None else f'{ratio:.2f}':>10}")
    record = {
        "command": " ".join(sys.argv),
        "runner": args.runner,
        "num_requests": args.num_requests,
        "rate": args.rate,
        "coefficients": engine.step_model.coefficients,
        "measured": measured,
        "simulated": sim,
    }
    (args.out / "sim_validate.json").write_text(json.dumps(record, indent=1))
    plot(args.out / "sim_validate.png", rows)
    print(f"wrote {args.out / 'sim_validate.json'} and .png")
    return 0


def plot(path: Path, rows: dict[str, tuple[float | None, float | None]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(3 * len(rows), 3))
    for ax, (name, (m, s)) in zip(axes, rows.items(), strict=True):
        ax.bar(["measured", "simulated"], [m or 0, s or 0], color=["tab:blue", "tab:orange"])
        ax.set_title(name, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
