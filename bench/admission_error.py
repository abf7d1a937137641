"""How far admission's replay (policy/admission.py's Replay) is from the real Scheduler on
queues with KV pressure or prefix hits, where it cannot be exact.

Each trial builds a random queue on the real Scheduler (4-16 interactive and batch
requests of several lengths arriving over a few steps, each step planned as the engine
plans it: PriorityBudgets under the priority policy; every sampled token a fixed id, as
the simulator's replica samples), then a new interactive prompt arrives. Admission's
Replay is given that queue exactly (every request's lengths, progress, class and place)
and predicts the new prompt's TTFT; the scheduler then runs until the prompt's first
token. Both are priced by the same step-time model, so the error is the planning's alone.
The replay knows no blocks (it never preempts for them, nor keeps the interactive
reserve), no prefix cache (it prices every prompt in full), and no request's end (none
finishes in it).

    .venv/bin/python bench/admission_error.py                       # ~5 min
    .venv/bin/python bench/admission_error.py --trials 20 --out /tmp/err

Scenarios:
  exact   blocks to spare, caching off, no request finishing: the control (the test's case)
  clean   the same, requests finishing (a lognormal number of output tokens, median 55)
  kv      clean on a cache of 50-95% of the blocks the queue holds at the first token with
          blocks to spare, and the default interactive reserve (20% of it at most)
  prefix  clean with caching on, 80% of prompts opening with one of three system prompts
  both    kv and prefix
Reported per scenario and policy: the share of trials whose predicted split ever differed,
and the TTFT's relative error (predicted / measured - 1): median, p90 and largest |error|,
the mean, the shares over and under. Writes admission_error.json and admission_error.png into --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenfleet.config import SchedulerConfig
from tokenfleet.core.kv_cache import KVCacheManager
from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE, Request
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.policy.admission import Replay, StepLimit
from tokenfleet.policy.harvest import PriorityBudgets, step_time_limit
from tokenfleet.policy.step_model import LinearStepCost, StepFeatures, step_features

# The start-up profile's fit of a run on this project's reference CPU (tests/policy
# test_admission.py's PROFILED), and the engine's default priority settings around it.
MODEL = LinearStepCost((0.0508, 0.00239, 0.00338, 9.11e-06, 8.99e-07))
TPOT_TARGET_S, MARGIN, MIN_PREFILL_CHUNK = 0.1326, 0.1, 16
BLOCK_SIZE = 16
NEVER_ENDS = SamplingParams(max_tokens=10**6, ignore_eos=True)
SCENARIOS = ("exact", "clean", "kv", "prefix", "both")
POLICIES = ("priority", "fcfs")
MAX_STEPS = 5000


@dataclass(frozen=True)
class Trial:
    scenario: str
    policy: str
    split_differed: bool
    predicted_s: float
    measured_s: float
    preemptions: int
    cached_tokens: int
    blocks_held: int  # at the new prompt's first token
    num_blocks: int  # of the cache, under KV pressure (0: blocks to spare)
    starved: bool  # no first token in MAX_STEPS steps

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def _prompt(rng: random.Random, prefixes: list[list[int]] | None, length: int) -> list[int]:
    tokens = [rng.randint(1, 30_000) for _ in range(length)]
    if prefixes is not None and rng.random() < 0.8:
        prefix = rng.choice(prefixes)
        tokens = prefix + tokens[: max(1, length - len(prefix))]
    return tokens


def run_trial(seed: int, scenario: str, policy: str, args: argparse.Namespace) -> Trial:
    """The trial of `seed`; under KV pressure the cache is a random 50-95% of the blocks
    the same queue holds at the new prompt's first token with blocks to spare."""
    if scenario not in ("kv", "both"):
        return _trial(seed, scenario, policy, args, None)
    spare = _trial(seed, scenario, policy, args, None)
    factor = random.Random(seed + 1).uniform(0.5, 0.95)
    return _trial(seed, scenario, policy, args, int(spare.blocks_held * factor))


def _trial(
    seed: int, scenario: str, policy: str, args: argparse.Namespace, num_blocks: int | None
) -> Trial:
    rng = random.Random(seed)
    kv_pressure = num_blocks is not None
    caching = scenario in ("prefix", "both")
    prefixes = (
        [[rng.randint(1, 30_000) for _ in range(rng.choice((64, 128, 256)))] for _ in range(3)]
        if caching
        else None
    )
    num_requests = rng.randint(4, args.max_requests)
    lengths = [min(int(rng.lognormvariate(5.0, 0.9)) + 1, 1500) for _ in range(num_requests)]
    outputs = [min(int(rng.lognormvariate(4.0, 0.8)) + 1, 400) for _ in range(num_requests)]
    new_len = min(int(rng.lognormvariate(5.0, 0.9)) + 1, 1500)
    if num_blocks is not None:  # at least one longest request's worth, as an engine has
        longest = max(*lengths, new_len) + max(outputs) + (256 if caching else 0)
        num_blocks = max(num_blocks, -(-longest // BLOCK_SIZE) + 1)
    config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=1 << 20,
        long_prefill_token_threshold=args.long_prefill_cap if policy == "priority" else 0,
        interactive_reserve_max_fraction=0.2 if kv_pressure else 0.0,
    )
    kv = KVCacheManager(num_blocks or 1 << 16, BLOCK_SIZE, enable_caching=caching)
    scheduler = Scheduler(config, kv)
    limit = None
    if policy == "priority":
        limit = StepLimit(step_time_limit(TPOT_TARGET_S, MARGIN), MIN_PREFILL_CHUNK, TPOT_TARGET_S)
    now = 0.0

    def add(req_id: str, prompt: list[int], interactive: bool, max_tokens: int) -> Request:
        nonlocal now
        now += 1e-3
        fcfs = policy == "fcfs"
        priority = PRIORITY_INTERACTIVE if interactive or fcfs else PRIORITY_BATCH
        params = NEVER_ENDS if scenario == "exact" else SamplingParams(max_tokens=max_tokens)
        request = Request(req_id, prompt, params, arrival_time=now, priority=priority)
        scheduler.add_request(request)
        return request

    def step() -> SchedulerOutput:
        nonlocal now
        now += 1.0
        if policy == "priority":
            budgets = PriorityBudgets(
                scheduler,
                MODEL,
                block_size=BLOCK_SIZE,
                tpot_target_s=TPOT_TARGET_S,
                margin=MARGIN,
                min_prefill_chunk=MIN_PREFILL_CHUNK,
            )
            out = budgets.schedule(now)
        else:
            out = scheduler.schedule(now)
        sampled = {s.req_id: 1 for s in out.scheduled if s.sample}
        scheduler.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
        return out

    arrivals = sorted(rng.randrange(args.warm_steps) for _ in lengths)
    for at in range(args.warm_steps):
        for i, length in enumerate(lengths):
            if arrivals[i] == at:
                add(f"r{i}", _prompt(rng, prefixes, length), rng.random() < 0.6, outputs[i])
        step()
    new = add("new", _prompt(rng, prefixes, new_len), True, 16)

    replay = Replay(
        config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        long_prefill_cap=config.long_prefill_token_threshold,
        limit=limit,
        model=MODEL,
        block_size=BLOCK_SIZE,
    )
    queue = [(r, True) for r in scheduler.running] + [(r, False) for r in scheduler.waiting]
    for request, running in queue:
        replay.add(
            request.req_id,
            request.num_tokens,
            running=running,
            num_computed_tokens=request.num_computed_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            interactive=request.is_interactive,
            arrival_time=request.arrival_time,
        )
    mine = replay.planner.requests["new"]
    predicted, predicted_splits = 0.0, []
    for _ in range(MAX_STEPS):
        chunks = replay.step()
        predicted_splits.append([(c.request.req_id, c.num_tokens) for c in chunks])
        predicted += MODEL.predict(
            StepFeatures.of_chunks((c.num_tokens, c.start_pos) for c in chunks)
        )
        if mine.num_computed_tokens >= mine.num_prompt_tokens:
            break
    preempted_before = scheduler.num_preemptions
    measured, differed = 0.0, False
    for i in range(MAX_STEPS):
        out = step()
        measured += MODEL.predict(step_features(out))
        split = [(s.req_id, s.num_tokens) for s in out.scheduled]
        differed |= i >= len(predicted_splits) or split != predicted_splits[i]
        if new.num_output_tokens:
            break
    return Trial(
        scenario,
        policy,
        differed,
        predicted,
        measured,
        scheduler.num_preemptions - preempted_before,
        new.num_cached_tokens or 0,
        kv.pool.num_blocks - kv.num_free_blocks,
        num_blocks or 0,
        not new.num_output_tokens,
    )


def summarize(all_trials: list[Trial]) -> dict[str, Any]:
    """The error over the trials whose prompt got its first token (`starved`: the share
    that did not, within MAX_STEPS steps)."""
    trials = [t for t in all_trials if not t.starved] or all_trials
    errors = sorted(t.error for t in trials)
    magnitudes = sorted(abs(e) for e in errors)

    def quantile(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "trials": len(all_trials),
        "starved": sum(t.starved for t in all_trials) / len(all_trials),
        "split_differed": sum(t.split_differed for t in all_trials) / len(all_trials),
        "abs_error_p50": quantile(magnitudes, 0.5),
        "abs_error_p90": quantile(magnitudes, 0.9),
        "abs_error_max": magnitudes[-1],
        "mean_error": statistics.fmean(errors),
        "over_share": sum(e > 1e-9 for e in errors) / len(errors),
        "under_share": sum(e < -1e-9 for e in errors) / len(errors),
        "mean_preemptions": statistics.fmean(t.preemptions for t in trials),
        "mean_cached_tokens_of_new": statistics.fmean(t.cached_tokens for t in trials),
    }


def plot(path: Path, trials: list[Trial]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(POLICIES), figsize=(11, 4), sharey=True)
    for ax, policy in zip(axes, POLICIES, strict=True):
        data = [
            [
                t.predicted_s / t.measured_s
                for t in trials
                if (t.scenario, t.policy) == (s, policy) and not t.starved
            ]
            or [1.0]
            for s in SCENARIOS
        ]
        ax.boxplot(data, whis=(5, 95), showfliers=True)
        ax.set_xticks(range(1, len(SCENARIOS) + 1), SCENARIOS)
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"{policy} policy")
    axes[0].set_ylabel("predicted / measured TTFT (whiskers p5-p95)")
    fig.suptitle("admission's replay against the scheduler, same queue and step-time model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Writes admission_error.json and admission_error.png into --out.",
    )
    parser.add_argument("--trials", type=int, default=200, help="per scenario and policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-requests", type=int, default=16, help="in a queue (4 at least)")
    parser.add_argument("--warm-steps", type=int, default=6, help="steps the queue builds over")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--long-prefill-cap", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()

    trials = [
        run_trial(args.seed * 1_000_003 + i, scenario, policy, args)
        for scenario in SCENARIOS
        for policy in POLICIES
        for i in range(args.trials)
    ]
    table = {
        f"{scenario}/{policy}": summarize(
            [t for t in trials if (t.scenario, t.policy) == (scenario, policy)]
        )
        for scenario in SCENARIOS
        for policy in POLICIES
    }
    print(
        "scenario/policy   trials  split differed  starved  |err| p50     p90     max"
        "   mean err  over  under"
    )
    for name, row in table.items():
        print(
            f"{name:18}{row['trials']:6}{row['split_differed']:14.0%}{row['starved']:9.0%}"
            f"{row['abs_error_p50']:11.1%}{row['abs_error_p90']:8.1%}"
            f"{row['abs_error_max']:8.1%}{row['mean_error']:+10.1%}"
            f"{row['over_share']:6.0%}{row['under_share']:7.0%}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": dict(zip(("a", "b", "c", "d", "e"), MODEL.coefficients, strict=True)),
        "summary": table,
        "trials": [asdict(t) | {"error": t.error} for t in trials],
    }
    (args.out / "admission_error.json").write_text(json.dumps(result, indent=1))
    plot(args.out / "admission_error.png", trials)
    print(f"wrote {args.out / 'admission_error.json'} and {args.out / 'admission_error.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
