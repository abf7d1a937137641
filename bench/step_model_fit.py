"""Step-time model fit: how well the start-up profile, and the online refit, predict the
runner time of real engine steps.

The engine runs its start-up profile (by hand here, to time it), then serves a realistic
mix: a request arriving every few steps, prompts of 16..512 tokens plus a few long ones
(1500..2000) whose later prefill chunks attend to a long context, outputs of 16..96
tokens, so that prefill chunks keep joining a dozen or so running decodes. Every step's
features and measured runner time are recorded, and predicted by

* *profile*: the coefficients fitted on the start-up profile alone;
* *online*: the model as the engine runs it (the profile as prior, refitted after every
  step from the recent window, scaled by the recent measured/fitted bias), each step
  predicted before it is observed; for the library's model also *online, no bias*, the
  same replay without that scaling;
* *held-out*: fitted on the profile plus every other step, scored on the steps between;

with the library's model (5 terms), without its prefill-attention term (4 terms), and,
as a diagnostic only, with two more terms for this CPU's two matmul regimes (fewer than
16 rows take a slower path). Errors are |predicted - measured| / measured, over all
steps and over two subsets: long-context prefill steps and decode-only steps of fewer
than 16 sequences.

    .venv/bin/python bench/step_model_fit.py               # about a minute on 1 thread
    .venv/bin/python bench/step_model_fit.py --num-requests 8 --out /tmp/bench   # quick

Writes `step_model_fit.json` and `step_model_fit.png` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from common.results import BUSY_WARNING, cpu_busy_fraction, format_table, machine_info

from tokenfleet import envs
from tokenfleet.checkpoint.bundled import prepare_bundled_model
from tokenfleet.config import CacheConfig, EngineConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.engine.core import EngineCore
from tokenfleet.policy.step_model import (
    TERMS,
    StepModelConfig,
    StepSample,
    StepTimeModel,
    fit_coefficients,
    nnls,
    relative_rows,
    step_seconds,
)

RESULT_NAME = "step_model_fit"
FIRST_ORDINARY_TOKEN_ID = 17  # SmolLM2's special tokens are ids 0..16
SMALL_ROWS = 16  # below this many rows this CPU's matmuls take a slower path
SMALL_BATCH = "5 terms + small-batch (diagnostic)"
MODELS = {
    "5 terms": TERMS,
    "4 terms (no prefill_attention)": TERMS[:-1],
    # Not in the library: what the two regimes of this CPU's matmuls cost the model.
    SMALL_BATCH: TERMS,
}


def draw_requests(num_requests: int, num_long: int, seed: int) -> list[tuple[list[int], int]]:
    """Prompts of 16..512 tokens, with `num_long` of 1500..2000 spread evenly among them."""
    rng = random.Random(seed)
    lengths = [rng.randint(16, 512) for _ in range(num_requests)]
    for i in range(num_long):
        lengths[(2 * i + 1) * num_requests // (2 * num_long)] = rng.randint(1500, 2000)
    return [
        ([rng.randrange(FIRST_ORDINARY_TOKEN_ID, 49152) for _ in range(n)], rng.randint(16, 96))
        for n in lengths
    ]


def run_workload(
    engine: EngineCore, requests: list[tuple[list[int], int]], arrival_interval: int
) -> tuple[list[StepSample], list[float]]:
    """Every step's sample, and the engine's own prediction for it (made before it ran).

    A request arrives every `arrival_interval` steps, so prefill chunks keep joining the
    running decodes, as on a server under steady load."""
    samples: list[StepSample] = []
    online: list[float] = []
    pending = list(enumerate(requests))
    num_steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and num_steps % arrival_interval == 0:
            i, (prompt, output_len) = pending.pop(0)
            params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
            engine.add_request(EngineCoreRequest(str(i), prompt, params, time.monotonic()))
        num_steps += 1
        model = engine.step_model
        coef = list(model.coefficients.values())  # as they stood before the step
        observed = model.num_observed
        engine.step()
        if model.num_observed > observed:
            sample = model.samples[-1]
            samples.append(sample)
            online.append(step_seconds(coef, sample.features))
    return samples, online


def relative_errors(samples: Sequence[StepSample], predicted: Sequence[float]) -> np.ndarray:
    measured = np.array([s.seconds for s in samples])
    return np.abs(np.array(predicted) - measured) / measured


def summarize(errors: np.ndarray) -> dict[str, float] | None:
    if not len(errors):
        return None
    p50, p90, p99 = np.quantile(errors, (0.5, 0.9, 0.99))
    return {
        "n": len(errors),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "mean": float(errors.mean()),
    }


def is_long_context(s: StepSample) -> bool:
    """A step whose prefill tokens attend to 1024+ tokens of context on average."""
    f = s.features
    return f.prefill_tokens > 0 and f.prefill_attention > 1024 * f.prefill_tokens


def is_small_decode(s: StepSample) -> bool:
    """A decode-only step of fewer than SMALL_ROWS sequences."""
    return s.features.prefill_tokens == 0 and s.features.decode_seqs < SMALL_ROWS


SUBSETS = {"all": lambda s: True, "long-context": is_long_context, "small-decode": is_small_decode}


def replay_online(
    prior: list[StepSample],
    samples: list[StepSample],
    terms: tuple[str, ...],
    bias_weight: float = StepModelConfig.bias_weight,
) -> list[float]:
    """The engine's online model with these terms, replayed over the same steps (with
    `bias_weight` 0: without the recent-bias scaling)."""
    model = StepTimeModel(StepModelConfig(terms=terms, bias_weight=bias_weight))
    model.set_prior(prior)
    predicted = []
    for s in samples:
        predicted.append(model.predict(s.features))
        model.observe(s.features, s.seconds)
    return predicted


def small_batch_rows(samples: Sequence[StepSample]) -> np.ndarray:
    """Relative rows with two more columns, for the diagnostic: [rows >= SMALL_ROWS] and
    rows * [rows < SMALL_ROWS], rows being the tokens the step's matmuls multiply."""
    rows = np.array([s.features.prefill_tokens + s.features.decode_seqs for s in samples])
    seconds = np.array([s.seconds for s in samples])
    small = rows < SMALL_ROWS
    extra = np.stack([~small, rows * small], axis=1) / seconds[:, None]
    return np.hstack([relative_rows(samples), extra])


def fit_small_batch(samples: Sequence[StepSample]) -> np.ndarray:
    a = small_batch_rows(samples)
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    coef: np.ndarray = nnls(a / norms, np.ones(len(a))) / norms
    return coef


def predict_small_batch(samples: Sequence[StepSample], coef: np.ndarray) -> list[float]:
    # Seven terms, not the library's model (step_seconds prices its five): the diagnostic's own.
    seconds = np.array([s.seconds for s in samples])
    return (small_batch_rows(samples) @ coef * seconds).tolist()


def evaluate(prior: list[StepSample], samples: list[StepSample]) -> dict[str, Any]:
    """Per model and fit: the steps scored (indices), their predictions, error summaries."""
    test = list(range(1, len(samples), 2))
    train = [samples[i] for i in range(0, len(samples), 2)]
    everything = list(range(len(samples)))
    results: dict[str, Any] = {}
    for name in MODELS:
        fits: dict[str, tuple[list[int], list[float]]] = {}
        if name == SMALL_BATCH:
            profile_coef = fit_small_batch(prior)
            held_coef = fit_small_batch(prior + train)
            fits["profile"] = (everything, predict_small_batch(samples, profile_coef))
            fits["held-out"] = (test, predict_small_batch([samples[i] for i in test], held_coef))
        else:
            terms = MODELS[name]
            profile_coef = fit_coefficients(prior, terms)
            held_coef = fit_coefficients(prior + train, terms)
            fits["profile"] = (everything, [_predict(samples[i], profile_coef) for i in everything])
            fits["online"] = (everything, replay_online(prior, samples, terms))
            if name == "5 terms":  # the same steps without the recent-bias scaling
                fits["online, no bias"] = (everything, replay_online(prior, samples, terms, 0))
            fits["held-out"] = (test, [_predict(samples[i], held_coef) for i in test])
        results[name] = {
            "profile_coefficients": profile_coef.tolist(),
            "held_out_coefficients": held_coef.tolist(),
            "predictions": {fit: {"steps": i, "seconds": p} for fit, (i, p) in fits.items()},
            "errors": {
                fit: {
                    subset: summarize(
                        relative_errors(
                            [samples[j] for j in i if keep(samples[j])],
                            [q for j, q in zip(i, p, strict=True) if keep(samples[j])],
                        )
                    )
                    for subset, keep in SUBSETS.items()
                }
                for fit, (i, p) in fits.items()
            },
        }
    return results


def _predict(sample: StepSample, coef: np.ndarray) -> float:
    return step_seconds(coef.tolist(), sample.features)


def plot(samples: list[StepSample], results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = np.array([s.seconds for s in samples]) * 1000
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5), sharex=True, sharey=True)
    for ax, fit in zip(axes, ("profile", "online", "held-out"), strict=True):
        for (name, r), marker in zip(results.items(), ("o", "x", "+"), strict=True):
            if fit not in r["predictions"]:
                continue
            scored = r["predictions"][fit]
            e = r["errors"][fit]["all"]
            ax.scatter(
                measured[scored["steps"]],
                np.array(scored["seconds"]) * 1000,
                s=14,
                marker=marker,
                alpha=0.6,
                label=f"{name}: p50 {e['p50']:.1%}, p99 {e['p99']:.1%}",
            )
        span = [measured.min() / 1.2, measured.max() * 1.2]
        ax.plot(span, span, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{fit} fit")
        ax.set_xlabel("measured runner time per step (ms)")
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("predicted (ms)")
    fig.suptitle("step-time model: predicted vs measured, bundled model on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def format_errors(results: dict[str, Any]) -> str:
    rows = [["model", "fit", "p50", "p90", "p99", "long-context p50", "small-decode p50"]]
    for name, r in results.items():
        for fit, e in r["errors"].items():
            subsets = [e["long-context"], e["small-decode"]]
            rows.append(
                [
                    name,
                    fit,
                    *(f"{e['all'][k]:.1%}" for k in ("p50", "p90", "p99")),
                    *("-" if x is None else f"{x['p50']:.1%} (n={x['n']})" for x in subsets),
                ]
            )
    return format_table(rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--num-long", type=int, default=3, help="of which long prompts")
    p.add_argument("--arrival-interval", type=int, default=3, help="steps between arrivals")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    busy = cpu_busy_fraction()
    if busy is not None and busy > BUSY_WARNING:
        print(f"warning: the CPUs are {busy:.0%} busy already; timings will be noisy")
    folder = prepare_bundled_model(envs.cache_dir() / "models", progress=False)
    config = EngineConfig(
        model=str(folder),
        num_threads=args.threads,
        cache=CacheConfig(kv_cache_memory=args.kv_cache_mib << 20),
        overlap=False,  # steps one after another: each step's prediction and time its own
    )
    # The engine's start-up profile, run by hand to time it apart from the model load.
    engine = EngineCore(config, step_model_config=StepModelConfig(profile=False))
    began = time.perf_counter()
    engine.profile_step_time()
    profile_s = time.perf_counter() - began
    prior = engine.step_model.prior
    requests = draw_requests(args.num_requests, args.num_long, args.seed)
    samples, engine_online = run_workload(engine, requests, args.arrival_interval)
    results = evaluate(prior, samples)
    # The replayed full model must be the engine's own online model, step for step.
    assert np.allclose(results["5 terms"]["predictions"]["online"]["seconds"], engine_online)

    print(f"profile: {len(prior)} steps in {profile_s:.2f} s; {len(samples)} workload steps")
    print(format_errors(results))
    for name, r in results.items():
        print(f"{name}: profile coefficients", [f"{c:.3g}" for c in r["profile_coefficients"]])

    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": machine_info(args.threads),
        "cpu_busy_before": busy,
        "load_average_after": os.getloadavg(),
        "profile_s": profile_s,
        "terms": list(TERMS),
        "small_batch_extra_terms": [f"rows >= {SMALL_ROWS}", f"rows * (rows < {SMALL_ROWS})"],
        "profile": [{"features": _features(s), "seconds": s.seconds} for s in prior],
        "steps": [{"features": _features(s), "seconds": s.seconds} for s in samples],
        "results": results,
    }
    (args.out / f"{RESULT_NAME}.json").write_text(json.dumps(record, indent=1))
    plot(samples, results, args.out / f"{RESULT_NAME}.png")
    print(f"wrote {args.out / RESULT_NAME}.json and .png")
    return 0


def _features(s: StepSample) -> dict[str, int]:
    f = s.features
    return {
        "prefill_tokens": f.prefill_tokens,
        "decode_seqs": f.decode_seqs,
        "kv_tokens_read": f.kv_tokens_read,
        "prefill_attention": f.prefill_attention,
    }


if __name__ == "__main__":
    sys.exit(main())
