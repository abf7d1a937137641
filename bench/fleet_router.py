"""Fleet router: prefix-cache affinity against least-loaded and round-robin routing, on one
seeded workload of shared system prompts, each policy on a fresh fleet in one run.

    4 replicas (`serve --replicas 4 --router POLICY`), the fixed runner with a step delay
    (`--fixed-step-time 0.004 --fixed-prefill-time 0.00002`: 4 ms a step plus 20 us per
    prefilled token) standing in for the model: a prefix-cache hit saves prefill time as
    it would on an accelerator; no model runs.

Workload (the same for every policy, from --seed): --system-prompts shared prompts of
random token ids, their lengths uniform in --prompt-tokens; --users callers, each an API key
of one key group (so one prefix cache), each bound to one system prompt drawn with Zipf
weights 1/(k+1)^--skew (0: uniform). Requests arrive as a Poisson process at --rate a
second for --duration seconds, each from a random user: its system prompt plus a distinct
suffix (--suffix-tokens), streamed from /v1/completions with --max-tokens tokens.

Per policy: the fleet-wide prefix hit rate (hit tokens / looked-up prompt tokens, the
/metrics deltas over the run: tokenfleet_prefix_cache_hit_tokens, and the looked-up tokens
from it and tokenfleet_prefix_cache_hit_rate), TTFT p50 / p99 seen by the client (sent to
first text), output tokens/s, refusals. Goal: prefix routing better than both baselines on
hit rate and TTFT p99.

The fleets run with --replica-timeout 10 (not the default 1.5): nothing here kills a
replica, and on a busy 2-core machine a ready replica's beat can come late by more than
1.5 s, which would move requests and skew the figures.

    .venv/bin/python bench/fleet_router.py                          # ~5 minutes on 2 cores
    .venv/bin/python bench/fleet_router.py --duration 15 --rate 10 --out /tmp/bench  # quick

Writes fleet_router.json and fleet_router.png into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from common.fleet import fleet_serve
from common.log import log
from common.results import RunStart, args_json, fmt_ms, format_table, write_result
from common.stats import percentile
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

MODEL = "smollm2-135m-instruct"
RESULT_NAME = "fleet_router"
POLICIES = ("prefix", "least-loaded", "round-robin")
COLORS = {"prefix": "tab:green", "least-loaded": "tab:blue", "round-robin": "tab:orange"}
OPERATOR_KEY = "operator-key-1"
GROUP = "tenant"
NUM_REPLICAS = 4
REPLICA_TIMEOUT_S = 10.0
# Token ids drawn for prompts: clear of the special tokens at the start of the vocabulary.
TOKEN_IDS = range(1000, 49000)
STAND_IN = (
    "the fixed runner with a prefill delay stands in for the model (no model runs: a step "
    "sleeps --fixed-step-time plus --fixed-prefill-time per prefilled token)"
)
TIMEOUT_S = 120.0


# -- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    at_s: float  # since the run's start
    user: int
    system_prompt: int
    prompt: list[int]


def build_workload(args: argparse.Namespace) -> tuple[list[Arrival], list[int]]:
    """The seeded arrivals, and each user's system prompt."""
    rng = random.Random(args.seed)
    lo, hi = args.prompt_tokens
    systems = [
        [rng.choice(TOKEN_IDS) for _ in range(rng.randint(lo, hi))]
        for _ in range(args.system_prompts)
    ]
    weights = [1 / (k + 1) ** args.skew for k in range(args.system_prompts)]
    bound = rng.choices(range(args.system_prompts), weights, k=args.users)
    arrivals: list[Arrival] = []
    at = 0.0
    lo, hi = args.suffix_tokens
    while True:
        at += rng.expovariate(args.rate)
        if at >= args.duration:
            return arrivals, bound
        user = rng.randrange(args.users)
        suffix = [rng.choice(TOKEN_IDS) for _ in range(rng.randint(lo, hi))]
        system = bound[user]
        arrivals.append(Arrival(at, user, system, systems[system] + suffix))


# -- one policy --------------------------------------------------------------------------------


@dataclass
class Outcome:
    at_s: float
    system_prompt: int
    status: int
    ttft_s: float | None = None
    end_s: float | None = None  # since the run's start
    output_tokens: int = 0
    error: str | None = None  # the connection failed (status -1)


async def send(http: httpx.AsyncClient, arrival: Arrival, max_tokens: int, t0: float) -> Outcome:
    """One streamed request, sent at its arrival time."""
    await asyncio.sleep(max(0.0, t0 + arrival.at_s - time.perf_counter()))
    body = {
        "model": MODEL,
        "prompt": arrival.prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer user-{arrival.user}"}
    sent = time.perf_counter()
    found = Outcome(arrival.at_s, arrival.system_prompt, 0)
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
            found.status = reply.status_code
            if reply.status_code != 200:
                await reply.aread()
                return found
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    found.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if found.ttft_s is None and choices and choices[0].get("text"):
                    found.ttft_s = time.perf_counter() - sent
    except httpx.TransportError as exc:  # counted, as a refusal is
        found.status, found.error = -1, f"{type(exc).__name__} {exc}"
        return found
    found.end_s = time.perf_counter() - t0
    return found


def scrape(url: str) -> dict[str, float]:
    """/metrics as {name or name{labels}: value}."""
    text = httpx.get(url + "/metrics", headers=operator(), timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def looked_up(metrics: dict[str, float]) -> float:
    """Prompt tokens looked up in the prefix caches, fleet-wide: hit tokens / hit rate
    (none is exported; nothing was sent before the first scrape, so 0 when nothing hit)."""
    hits = metrics.get("tokenfleet_prefix_cache_hit_tokens_total", 0.0)
    rate = metrics.get("tokenfleet_prefix_cache_hit_rate", 0.0)
    return hits / rate if rate > 0 else 0.0


def operator() -> dict[str, str]:
    return {"authorization": f"Bearer {OPERATOR_KEY}"}


async def drive(url: str, arrivals: list[Arrival], max_tokens: int) -> list[Outcome]:
    # Idle connections dropped before the server's keep-alive timeout (5 s) drops them: else
    # a request sent on one the server is closing fails (ReadError).
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200, keepalive_expiry=2)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as http:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(send(http, a, max_tokens, t0)) for a in arrivals]
        with tqdm(total=len(tasks), desc="requests", unit="req", leave=False) as bar:
            for task in asyncio.as_completed(tasks):
                await task
                bar.update(1)
        return [task.result() for task in tasks]


def run_policy(
    args: argparse.Namespace, tmp: Path, policy: str, arrivals: list[Arrival]
) -> dict[str, Any]:
    flags = ["--runner", "fixed", "--num-threads", str(args.num_threads)]
    flags += ["--fixed-step-time", str(args.fixed_step_time)]
    flags += ["--fixed-prefill-time", str(args.fixed_prefill_time)]
    flags += ["--router", policy, "--replica-timeout", str(REPLICA_TIMEOUT_S)]
    flags += ["--api-keys-file", str(tmp / "keys.txt"), "--operator-key", OPERATOR_KEY]
    flags += list(args.serve_flag)
    with fleet_serve(policy, tmp, flags, NUM_REPLICAS, headers=operator()) as server:
        before = scrape(server.url)
        log(f"{policy}: {len(arrivals)} requests over {args.duration:.0f} s")
        t0 = time.perf_counter()
        outcomes = asyncio.run(drive(server.url, arrivals, args.max_tokens))
        wall_s = time.perf_counter() - t0
        time.sleep(0.5)  # a beat from every replica: its latest counts
        after = scrape(server.url)
        statuses = Counter(str(o.status) for o in outcomes if o.status != 200)
        if statuses:
            lines = server.log.read_text(errors="replace").splitlines()
            trouble = [ln for ln in lines if " ERROR " in ln or " WARNING " in ln][-20:]
            log(f"{policy}: not served, by status (-1: connection failed): {dict(statuses)}")
            if trouble:
                log("the server's log says:\n" + "\n".join(trouble))
    hit_key = "tokenfleet_prefix_cache_hit_tokens_total"
    hits = after.get(hit_key, 0.0) - before.get(hit_key, 0.0)
    queries = looked_up(after) - looked_up(before)
    served = [o for o in outcomes if o.status == 200 and o.ttft_s is not None]
    ttfts = [o.ttft_s for o in served if o.ttft_s is not None]
    first = min(o.at_s for o in outcomes)
    last = max((o.end_s for o in served if o.end_s is not None), default=first)
    output = sum(o.output_tokens for o in served)
    per_replica = {
        key.split("replica=")[1].rstrip("}"): value - before.get(key, 0.0)
        for key, value in after.items()
        if key.startswith("tokenfleet_replica_prefix_cache_hit_tokens_total{")
    }
    return {
        "policy": policy,
        "requests": len(outcomes),
        "served": len(served),
        "refused": sum(o.status != 200 for o in outcomes),
        "prefix_hit_tokens": hits,
        "prefix_query_tokens": queries,
        "prefix_hit_rate": hits / queries if queries else float("nan"),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        "output_tokens": output,
        "output_tokens_per_s": output / (last - first) if last > first else float("nan"),
        "wall_s": wall_s,
        "replica_prefix_hit_tokens": per_replica,
        "outcomes": [asdict(o) for o in outcomes],
    }


# -- the run -----------------------------------------------------------------------------------


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    policies = [p["policy"] for p in result["policies"]]
    panels: list[tuple[str, str, float, str]] = [  # title, figure, scale, format
        ("prefix hit rate (fleet-wide)", "prefix_hit_rate", 1, "{:.1%}"),
        ("TTFT p50 (ms)", "ttft_p50_s", 1000, "{:.0f}"),
        ("TTFT p99 (ms)", "ttft_p99_s", 1000, "{:.0f}"),
        ("output tokens/s", "output_tokens_per_s", 1, "{:.0f}"),
    ]
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    for ax, (title, key, scale, fmt) in zip(fig.subplots(1, len(panels)), panels, strict=True):
        values = [p[key] * scale for p in result["policies"]]
        bars = ax.bar(policies, values, color=[COLORS[p] for p in policies])
        ax.bar_label(bars, [fmt.format(v) for v in values])
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=15)
    w = result["workload"]
    fig.suptitle(
        f"{NUM_REPLICAS} replicas, {w['system_prompts']} system prompts of "
        f"{w['prompt_tokens'][0]}-{w['prompt_tokens'][1]} tokens, {w['rate']}/s for "
        f"{w['duration_s']:.0f} s; fixed runner with a prefill delay standing in for the model"
    )
    fig.savefig(path, dpi=120)


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--policies", default=",".join(POLICIES), help="router policies to run, a,b,...")
    # 64 prompts: more than one replica's cache holds (the fixed runner's 4096 blocks, 64k
    # tokens), as a fleet's prompts are; with 8, every replica caches them all and only
    # cold misses differ.
    add("--system-prompts", type=int, default=64, help="shared system prompts")
    add("--prompt-tokens", type=span, default=(1024, 2048), help="system prompt length, lo:hi")
    add("--suffix-tokens", type=span, default=(16, 64), help="user suffix length, lo:hi")
    add("--users", type=int, default=256, help="callers (keys of one key group)")
    add("--skew", type=float, default=0.5, help="Zipf exponent of the system prompts (0: uniform)")
    add("--rate", type=float, default=20.0, help="requests a second (Poisson)")
    add("--duration", type=float, default=60.0, help="seconds of arrivals")
    add("--max-tokens", type=int, default=32, help="output tokens a request")
    add("--fixed-step-time", type=float, default=0.004, help="seconds a step (fixed runner)")
    add("--fixed-prefill-time", type=float, default=0.00002, help="seconds a prefilled token")
    add("--seed", type=int, default=0)
    add("--num-threads", type=int, default=1, help="torch threads a replica")
    add("--serve-flag", action="append", default=[], help="one more `serve` argument (repeat)")
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    unknown = set(policies) - set(POLICIES)
    if unknown:
        parser.error(f"no such policy: {sorted(unknown)}; {list(POLICIES)}")

    start = RunStart.now()
    arrivals, bound = build_workload(args)
    per_prompt = [bound.count(k) for k in range(args.system_prompts)]
    log(f"{len(arrivals)} requests; users per system prompt {per_prompt}")
    log(f"note: {STAND_IN}")
    results = []
    with tempfile.TemporaryDirectory(prefix="tokenfleet-fleet-router-") as tmp_name:
        tmp = Path(tmp_name)
        keys = [f"user-{u} {GROUP}" for u in range(args.users)]
        (tmp / "keys.txt").write_text("\n".join(keys) + "\n")
        for policy in policies:
            found = run_policy(args, tmp, policy, arrivals)
            results.append(found)
            log(
                f"{policy}: hit rate {found['prefix_hit_rate']:.1%}, TTFT p50 "
                f"{fmt_ms(found['ttft_p50_s'])} ms p99 {fmt_ms(found['ttft_p99_s'])} ms, "
                f"{found['output_tokens_per_s']:.0f} tok/s, {found['refused']} refused"
            )

    rows = [["policy", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "served", "refused"]]
    for p in results:
        rows.append(
            [
                p["policy"],
                f"{p['prefix_hit_rate']:.1%}",
                fmt_ms(p["ttft_p50_s"]),
                fmt_ms(p["ttft_p99_s"]),
                f"{p['output_tokens_per_s']:.0f}",
                str(p["served"]),
                str(p["refused"]),
            ]
        )
    print(format_table(rows))
    goal = None
    if "prefix" in policies and len(policies) > 1:
        prefix = next(p for p in results if p["policy"] == "prefix")
        others = [p for p in results if p["policy"] != "prefix"]
        goal = {
            "hit_rate": all(prefix["prefix_hit_rate"] > p["prefix_hit_rate"] for p in others),
            "ttft_p99": all(prefix["ttft_p99_s"] < p["ttft_p99_s"] for p in others),
        }
        met = "met" if all(goal.values()) else "not met"
        print(f"goal: prefix better than both baselines on hit rate and TTFT p99: {met} {goal}")
    print(f"note: {STAND_IN}")
    result = {
        "stand_in": STAND_IN,
        "replicas": NUM_REPLICAS,
        "replica_timeout_s": REPLICA_TIMEOUT_S,
        "workload": {
            "requests": len(arrivals),
            "system_prompts": args.system_prompts,
            "prompt_tokens": list(args.prompt_tokens),
            "suffix_tokens": list(args.suffix_tokens),
            "users": args.users,
            "users_per_system_prompt": per_prompt,
            "skew": args.skew,
            "rate": args.rate,
            "duration_s": args.duration,
            "max_tokens": args.max_tokens,
        },
        "goal_met": goal,
        "policies": results,
    }
    out = start.provenance(args) | {"args": args_json(args), **result}
    write_result(args.out, RESULT_NAME, out, lambda path: plot(path, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
