"""Failover: SIGKILL the replica serving streams, round after round, while greedy and seeded
sampled streams and a batch run; every stream must go on exactly where it was, every batch
request must get exactly one result, and the next token must come soon.

    `tokenfleet serve --replicas 2 --num-threads 1` (the bundled model; default settings
    but --replica-restarts, which must cover the kills: Ray restarts a killed replica at
    most that many times)

Each round: --greedy streams (temperature 0) and --seeded streams (temperature 0.8, a seed
each) are started one after another on /v1/chat/completions (EOS ignored, --max-tokens
each); after each one's first event GET /admin/fleet tells which replica took it
(requests_from_this_gateway went up there). Then a Message Batch of --batch requests
(the official anthropic client). Once every stream has --kill-after tokens, the replica
holding most of them is sent SIGKILL (its pid from /admin/fleet), and /admin/fleet is read
every 20 ms until the gateway no longer has it ready (kill -> detected). The round ends
when the streams and the batch are done and the killed replica is back (ready, its
restarts counted up).

Round 0 kills nothing: its texts are the unmoved references. Per round and in all: every
stream's text equal to its reference, every batch request with exactly one result (and
its text equal to round 0's), and for each moved stream (on the killed replica, not done
at the kill) the time from the kill to its next token (tokens the dead replica had sent
before it died and that arrive before the detection are in flight, not counted). Goal:
p99 <= 3 s.

    .venv/bin/python bench/failover.py                           # ~4 minutes on 2 cores
    .venv/bin/python bench/failover.py --rounds 1 --max-tokens 32 --out /tmp/bench  # quick

Writes failover.json and failover.png into --out. Exits 1 if a text differs or a batch
request has no result or more than one.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
from common.fleet import fleet_serve, fleet_state, wait_replicas_ready
from common.log import log
from common.results import RunStart, args_json, fmt_ms, format_table, write_result
from common.stats import percentile

MODEL = "smollm2-135m-instruct"
RESULT_NAME = "failover"
NUM_REPLICAS = 2
GOAL_P99_S = 3.0
SEED_BASE = 1000
TOPICS = [
    "a lighthouse keeper",
    "a dragon who collects maps",
    "a city under the sea",
    "a clockmaker's apprentice",
    "a journey across a desert",
    "a robot learning to paint",
    "a winter market",
    "an old ship's cat",
]
TIMEOUT_S = 600.0


# -- streams ------------------------------------------------------------------------------------


@dataclass
class Stream:
    index: int
    seeded: bool
    text: str = ""
    times: list[float] = field(default_factory=list)  # perf_counter of each text event
    replica: int | None = None
    done_at: float | None = None
    error: str | None = None  # the status and body of a refused stream
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def tokens_after(self, t: float) -> list[float]:
        return [x for x in self.times if x > t]


def stream_body(args: argparse.Namespace, stream: Stream) -> dict[str, Any]:
    topic = TOPICS[stream.index % len(TOPICS)]
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me a long story about {topic}."}],
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    if stream.seeded:
        body |= {"temperature": 0.8, "seed": SEED_BASE + stream.index}
    else:
        body |= {"temperature": 0}
    return body


async def run_stream(http: httpx.AsyncClient, args: argparse.Namespace, stream: Stream) -> None:
    async with http.stream("POST", "/v1/chat/completions", json=stream_body(args, stream)) as r:
        if r.status_code != 200:
            stream.error = f"{r.status_code} {(await r.aread())[:200]!r}"
            stream.done_at = time.perf_counter()
            stream.started.set()
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            stream.started.set()
            choices = json.loads(line[6:]).get("choices") or []
            text = choices[0]["delta"].get("content") if choices else None
            if text:
                stream.times.append(time.perf_counter())
                stream.text += text
    stream.done_at = time.perf_counter()


# -- the batch ----------------------------------------------------------------------------------


def batch_requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"b{i}",
            "params": {
                "model": MODEL,
                "max_tokens": args.batch_tokens,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Count from {i} to {i + 30}."}],
            },
        }
        for i in range(args.batch)
    ]


async def run_batch(client: anthropic.AsyncAnthropic, args: argparse.Namespace) -> dict[str, Any]:
    """Submit the batch, wait for its end: its results per custom_id (texts, counts)."""
    batch = await client.messages.batches.create(requests=batch_requests(args))  # type: ignore[arg-type]
    deadline = time.monotonic() + TIMEOUT_S
    while batch.processing_status != "ended":
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch.id} not ended in {TIMEOUT_S} s")
        await asyncio.sleep(0.5)
        batch = await client.messages.batches.retrieve(batch.id)
    counts: Counter[str] = Counter()
    texts: dict[str, str] = {}
    outcomes: Counter[str] = Counter()
    async for line in await client.messages.batches.results(batch.id):
        counts[line.custom_id] += 1
        outcomes[line.result.type] += 1
        if line.result.type == "succeeded":
            texts[line.custom_id] = "".join(
                b.text for b in line.result.message.content if b.type == "text"
            )
    return {"counts": counts, "texts": texts, "outcomes": dict(outcomes)}


# -- one round ----------------------------------------------------------------------------------


async def admin(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    answer = await http.get("/admin/fleet")
    answer.raise_for_status()
    return sorted(answer.json()["replicas"], key=lambda r: r["id"])


def counts_by_replica(replicas: list[dict[str, Any]]) -> dict[int, int]:
    return {r["id"]: r["requests_from_this_gateway"] for r in replicas}


async def one_round(url: str, args: argparse.Namespace, kill: bool) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64)
    async with (
        httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as http,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as client,
    ):
        streams = [Stream(i, seeded=i >= args.greedy) for i in range(args.greedy + args.seeded)]
        tasks = []
        before = counts_by_replica(await admin(http))
        for stream in streams:  # one at a time: the replica whose count goes up took it
            tasks.append(asyncio.create_task(run_stream(http, args, stream)))
            await stream.started.wait()
            now = counts_by_replica(await admin(http))
            up = [i for i in now if now[i] == before.get(i, 0) + 1]
            stream.replica = up[0] if len(up) == 1 else None
            before = now
        batch_task = asyncio.create_task(run_batch(client, args))
        while any(len(s.times) < args.kill_after and s.done_at is None for s in streams):
            if any(t.done() and t.exception() for t in tasks):
                break
            await asyncio.sleep(0.01)
        found: dict[str, Any] = {"killed": None}
        if kill:
            found = await kill_serving(http, streams)
        await asyncio.gather(*tasks)
        batch = await batch_task
    return {"streams": streams, "batch": batch, **found}


async def kill_serving(http: httpx.AsyncClient, streams: list[Stream]) -> dict[str, Any]:
    """SIGKILL the replica with most of the streams not done; poll until the gateway has it
    no longer ready."""
    on: Counter[int] = Counter(
        s.replica for s in streams if s.done_at is None and s.replica is not None
    )
    replicas = {r["id"]: r for r in await admin(http)}
    victim = on.most_common(1)[0][0] if on else None
    if victim is None:  # no mapping: the one with most of this gateway's requests
        victim = max(replicas, key=lambda i: replicas[i]["requests_from_this_gateway"])
    pid = replicas[victim]["pid"]
    moving = [s.index for s in streams if s.replica == victim and s.done_at is None]
    requests_on_it = replicas[victim]["requests_from_this_gateway"]
    t_kill = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    t_detect = None
    while time.perf_counter() - t_kill < 60:
        state = {r["id"]: r for r in await admin(http)}[victim]
        if state["state"] != "ready" or state["pid"] != pid:
            t_detect = time.perf_counter()
            break
        await asyncio.sleep(0.02)
    return {
        "killed": {"replica": victim, "pid": pid, "requests_on_it": requests_on_it},
        "t_kill": t_kill,
        "t_detect": t_detect,
        "moved": moving,
    }


def score_round(
    r: int, found: dict[str, Any], reference: dict[str, Any] | None, num_batch: int
) -> dict[str, Any]:
    """One round's figures against round 0's texts (None: this is round 0)."""
    streams: list[Stream] = found["streams"]
    batch = found["batch"]
    ref_texts = reference["texts"] if reference else [s.text for s in streams]
    ref_batch = reference["batch_texts"] if reference else batch["texts"]
    differs = [s.index for s in streams if s.error or s.text != ref_texts[s.index]]
    counts: Counter[str] = batch["counts"]
    expected = {f"b{i}" for i in range(num_batch)}
    one_each = set(counts) == expected and all(n == 1 for n in counts.values())
    batch_differs = sorted(k for k, t in batch["texts"].items() if ref_batch.get(k) != t)
    result: dict[str, Any] = {
        "round": r,
        "killed": found["killed"],
        "streams": len(streams),
        "streams_exact": len(streams) - len(differs),
        "streams_differing": differs,
        "streams_failed": {s.index: s.error for s in streams if s.error},
        "stream_replicas": [s.replica for s in streams],
        "batch_results": sum(counts.values()),
        "batch_one_result_each": one_each,
        "batch_outcomes": batch["outcomes"],
        "batch_texts_differing": batch_differs,
    }
    if found["killed"] is not None:
        t_kill, t_detect = found["t_kill"], found["t_detect"]
        after = t_detect if t_detect is not None else t_kill
        moved = [streams[i] for i in found["moved"]]
        to_next = []
        in_flight = 0
        for s in moved:
            later = s.tokens_after(after)
            in_flight += len(s.tokens_after(t_kill)) - len(later)
            if later:
                to_next.append(later[0] - t_kill)
        unmoved = [s for s in streams if s.index not in found["moved"] and s.done_at]
        gaps = [
            b - a for s in unmoved for a, b in itertools.pairwise([t_kill, *s.tokens_after(t_kill)])
        ]
        result |= {
            "moved_streams": found["moved"],
            "moved_exact": sum(s.index not in differs for s in moved),
            "kill_to_detected_s": None if t_detect is None else t_detect - t_kill,
            "kill_to_next_token_s": to_next,
            "tokens_in_flight": in_flight,
            "unmoved_max_gap_after_kill_s": max(gaps, default=None),
        }
    return result


# -- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    rounds = []
    reference: dict[str, Any] | None = None
    for r in range(args.rounds + 1):
        kill = r > 0
        t0 = time.monotonic()
        found = asyncio.run(one_round(url, args, kill))
        scored = score_round(r, found, reference, args.batch)
        if reference is None:
            reference = {
                "texts": [s.text for s in found["streams"]],
                "batch_texts": found["batch"]["texts"],
            }
        if kill:
            log(f"round {r}: waiting for replica {scored['killed']['replica']} to come back")
            t_back = time.monotonic()
            wait_replicas_ready(url, NUM_REPLICAS, args.restart_timeout, restarts=r)
            scored["restart_s"] = time.monotonic() - t_back
        scored["wall_s"] = time.monotonic() - t0
        rounds.append(scored)
        nexts = ", ".join(f"{x:.2f}" for x in scored.get("kill_to_next_token_s", []))
        log(
            f"round {r}/{args.rounds}: streams exact {scored['streams_exact']}/"
            f"{scored['streams']}, batch one result each {scored['batch_one_result_each']}"
            + (
                f", killed replica {scored['killed']['replica']} "
                f"({len(scored['moved_streams'])} streams moved), detected after "
                f"{fmt_ms(scored['kill_to_detected_s'])} ms, kill -> next token [{nexts}] s"
                if kill
                else " (reference)"
            )
        )
    killed = rounds[1:]
    to_next = [x for k in killed for x in k["kill_to_next_token_s"]]
    detected = [k["kill_to_detected_s"] for k in killed if k["kill_to_detected_s"] is not None]
    return {
        "reference": {"stream_texts": reference["texts"] if reference else []},
        "rounds": rounds,
        "all": {
            "rounds": len(killed),
            "streams": sum(k["streams"] for k in killed),
            "streams_exact": sum(k["streams_exact"] for k in killed),
            "moved_streams": sum(len(k["moved_streams"]) for k in killed),
            "moved_exact": sum(k["moved_exact"] for k in killed),
            "batch_requests": sum(k["batch_results"] for k in killed),
            "batch_one_result_each": all(k["batch_one_result_each"] for k in killed),
            "batch_texts_differing": sum(len(k["batch_texts_differing"]) for k in killed),
            "kill_to_next_token_p50_s": percentile(to_next, 50),
            "kill_to_next_token_p99_s": percentile(to_next, 99),
            "kill_to_next_token_max_s": max(to_next, default=float("nan")),
            "kill_to_detected_p50_s": percentile(detected, 50),
            "kill_to_detected_max_s": max(detected, default=float("nan")),
            "goal_p99_s": GOAL_P99_S,
        },
        "kill_to_next_token_s": to_next,
    }


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    spread, by_round = fig.subplots(1, 2)
    a = result["all"]
    values = sorted(result["kill_to_next_token_s"])
    shares = [(i + 1) / len(values) for i in range(len(values))]
    spread.step([0.0, *values], [0.0, *shares], where="post")
    spread.set_ylim(0, 1.05)
    by_round.set_xlabel("seconds from SIGKILL to the moved stream's next token")
    for k in result["rounds"][1:]:
        got = k["kill_to_next_token_s"]
        by_round.scatter(got, [k["round"]] * len(got), color="tab:blue", zorder=3)
        if k["kill_to_detected_s"] is not None:
            by_round.scatter([k["kill_to_detected_s"]], [k["round"]], marker="|", s=300, c="k")
    by_round.scatter([], [], marker="|", s=300, c="k", label="kill -> detected (/admin/fleet)")
    for ax in (spread, by_round):
        for q, style in (("p50", ":"), ("p99", "--")):
            value = a[f"kill_to_next_token_{q}_s"]
            ax.axvline(value, color="tab:blue", ls=style, label=f"{q} {value:.2f} s")
        ax.axvline(GOAL_P99_S, color="tab:red", label=f"goal: p99 <= {GOAL_P99_S:.0f} s")
        ax.set_xlim(left=0, right=max([GOAL_P99_S, *values]) * 1.1)
        ax.legend(loc="lower right" if ax is spread else "upper left", fontsize="small")
    spread.set_xlabel("seconds from SIGKILL to the moved stream's next token")
    spread.set_ylabel("share of moved streams")
    spread.set_title(f"{a['moved_streams']} moved streams in {a['rounds']} rounds")
    by_round.set_ylabel("round")
    by_round.set_yticks([k["round"] for k in result["rounds"][1:]])
    by_round.set_title(
        f"texts exact {a['streams_exact']}/{a['streams']}; batch one result each: "
        f"{a['batch_one_result_each']}"
    )
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--rounds", type=int, default=5, help="rounds with a kill (after the reference round)")
    add("--greedy", type=int, default=4, help="greedy streams a round")
    add("--seeded", type=int, default=4, help="seeded sampled streams a round")
    add("--max-tokens", type=int, default=64, help="tokens a stream")
    add("--kill-after", type=int, default=12, help="tokens every stream has before the kill")
    add("--batch", type=int, default=24, help="requests in each round's batch")
    add("--batch-tokens", type=int, default=16, help="max_tokens of a batch request")
    add("--restart-timeout", type=float, default=300, help="seconds for a replica to come back")
    add("--num-threads", type=int, default=1, help="torch threads a replica")
    add("--serve-flag", action="append", default=[], help="one more `serve` argument (repeat)")
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    start = RunStart.now()
    flags = ["--num-threads", str(args.num_threads), "--replica-restarts", str(args.rounds)]
    flags += list(args.serve_flag)
    t0 = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="tokenfleet-failover-") as tmp_name,
        fleet_serve("failover", Path(tmp_name), flags, NUM_REPLICAS) as server,
    ):
        start_s = time.monotonic() - t0
        log(f"replicas: {[(r['id'], r['pid']) for r in fleet_state(server.url)]}")
        result = run(args, server.url)
        log_text = server.log.read_text(errors="replace")
    why = Counter(
        line.split("is dead to this gateway: ")[1].split(" for ")[0].strip()
        for line in log_text.splitlines()
        if "is dead to this gateway: " in line
    )
    result |= {"start_s": start_s, "dead_because": dict(why)}

    a = result["all"]
    rows = [["round", "killed", "moved", "exact", "batch 1 each", "detected ms", "next token s"]]
    for k in result["rounds"]:
        killed = k["killed"]
        rows.append(
            [
                str(k["round"]),
                "-" if killed is None else f"replica {killed['replica']}",
                str(len(k.get("moved_streams", []))),
                f"{k['streams_exact']}/{k['streams']}",
                str(k["batch_one_result_each"]),
                fmt_ms(k.get("kill_to_detected_s")),
                " ".join(f"{x:.2f}" for x in k.get("kill_to_next_token_s", [])) or "-",
            ]
        )
    print(format_table(rows))
    print(
        f"in all: streams exact {a['streams_exact']}/{a['streams']} (moved {a['moved_exact']}/"
        f"{a['moved_streams']}); batch one result each: {a['batch_one_result_each']} "
        f"({a['batch_requests']} results, {a['batch_texts_differing']} texts differ); "
        f"kill -> next token p50 {a['kill_to_next_token_p50_s']:.2f} s, p99 "
        f"{a['kill_to_next_token_p99_s']:.2f} s (goal <= {GOAL_P99_S:.0f} s: "
        f"{'met' if a['kill_to_next_token_p99_s'] <= GOAL_P99_S else 'not met'}); "
        f"kill -> detected p50 {fmt_ms(a['kill_to_detected_p50_s'])} ms; "
        f"dead because: {result['dead_because']}"
    )
    out = start.provenance(args) | {"args": args_json(args), **result}
    write_result(args.out, RESULT_NAME, out, lambda path: plot(path, result))
    exact = a["streams_exact"] == a["streams"] and a["batch_texts_differing"] == 0
    return 0 if exact and a["batch_one_result_each"] else 1


if __name__ == "__main__":
    sys.exit(main())
