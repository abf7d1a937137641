"""Fleet overhead: what the gateway adds per request with 16 replicas against 1, both on Ray
(`serve --replicas`), and the plain single-engine gateway (no --replicas) for reference.

Three servers run side by side, each with the fixed runner and no step delay (a step costs
only the engine's own bookkeeping), one torch thread a replica:

    plain     `tokenfleet serve`: the gateway and one engine process (ZMQ)
    fleet-1   `tokenfleet serve --replicas 1`: one replica, a Ray actor
    fleet-16  `tokenfleet serve --replicas 16`: sixteen replicas (--replicas sets it)

In each of --rounds rounds, each server in turn (the order rotated every round) takes
--sequential non-streamed requests one after another (max_tokens 1, keep-alive) and one
burst of --burst streamed requests sent at once (TTFT: sent to the first text). After a
warm-up of the same on each. Reports per server the sequential latency median and p99
and the burst's median TTFT over all rounds, and the ratios fleet-N / fleet-1 (and
fleet-1 / plain). The resident memory of each server's processes and its start time.

The fleets run with --replica-timeout 10 (not the default 1.5): nothing here kills a
replica, and on a busy 2-core machine a ready replica's beat can come late by more than
1.5 s, which would move requests and skew the figures.

    .venv/bin/python bench/fleet_overhead.py                       # ~4 minutes on 2 cores
    .venv/bin/python bench/fleet_overhead.py --replicas 4 --rounds 2 --sequential 30 \\
        --out /tmp/bench                                           # quick check

Writes fleet_overhead.json and fleet_overhead.png into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from common.fleet import fleet_serve, session_rss_mib
from common.log import log
from common.results import RunStart, args_json, fmt_ms, format_table, write_result
from common.server import Server, tokenfleet_serve
from common.stats import percentile
from tqdm import tqdm

MODEL = "smollm2-135m-instruct"
RESULT_NAME = "fleet_overhead"
REPLICA_TIMEOUT_S = 10.0
MIB_PER_REPLICA = 450  # resident memory of a fixed-runner replica (torch imported), with room
TIMEOUT_S = 120.0


def body(i: int, stream: bool, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": f"Request number {i}: say something.",
        "max_tokens": max_tokens,
        "stream": stream,
    }


def sequential(url: str, first: int, count: int, refused: Counter[str]) -> list[float]:
    """`count` non-streamed requests one after another on one keep-alive connection: the
    latency (s) of each one served; the others counted in `refused` by status."""
    latencies = []
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
        for i in range(first, first + count):
            t0 = time.perf_counter()
            reply = http.post("/v1/completions", json=body(i, False, 1))
            if reply.status_code == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                refused[str(reply.status_code)] += 1
    return latencies


async def burst(
    http: httpx.AsyncClient, first: int, count: int, max_tokens: int, refused: Counter[str]
) -> list[float]:
    """`count` streamed requests sent at once: the time to its first text (s) of each one
    served; the others counted in `refused` by status."""

    async def one(i: int) -> float | None:
        t0 = time.perf_counter()
        ttft = None
        payload = body(i, True, max_tokens)
        async with http.stream("POST", "/v1/completions", json=payload) as reply:
            if reply.status_code != 200:
                await reply.aread()
                refused[str(reply.status_code)] += 1
                return None
            async for line in reply.aiter_lines():
                data = line.startswith("data: {")
                if ttft is None and data and json.loads(line[6:])["choices"][0].get("text"):
                    ttft = time.perf_counter() - t0
        if ttft is None:
            raise RuntimeError("a stream ended without text")
        return ttft

    found = await asyncio.gather(*(one(first + i) for i in range(count)))
    return [ttft for ttft in found if ttft is not None]


async def bursts(
    url: str, first: int, count: int, size: int, max_tokens: int, refused: Counter[str]
) -> list[float]:
    """A warm burst (connections opened, not counted), then `count` bursts of `size`."""
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as http:
        await burst(http, first, size, max_tokens, refused)
        ttfts = []
        for b in range(count):
            ttfts += await burst(http, first + (b + 1) * size, size, max_tokens, refused)
        return ttfts


def mem_available_mib() -> float:
    """MemAvailable of /proc/meminfo: what can be had without swapping, MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- the run ----------------------------------------------------------------------------------


def start_servers(
    stack: ExitStack, args: argparse.Namespace, tmp: Path
) -> tuple[dict[str, Server], dict[str, dict[str, float]]]:
    """plain, fleet-1 and fleet-N started one after another, all left running; each one's
    start time and resident memory."""
    flags = ["--runner", "fixed", "--num-threads", "1"]
    fleet_flags = [*flags, "--replica-timeout", str(REPLICA_TIMEOUT_S)]
    servers: dict[str, Server] = {}
    info: dict[str, dict[str, float]] = {}
    plans = [("plain", 0), ("fleet-1", 1), (f"fleet-{args.replicas}", args.replicas)]
    for name, replicas in plans:
        t0 = time.monotonic()
        if replicas:
            server = stack.enter_context(
                fleet_serve(name, tmp, fleet_flags, replicas, args.start_timeout)
            )
        else:
            server = stack.enter_context(tokenfleet_serve(name, tmp, flags, args.start_timeout))
        servers[name] = server
        info[name] = {
            "replicas": replicas,
            "start_s": time.monotonic() - t0,
            "rss_mib": session_rss_mib(server.process.pid),
        }
        log(f"{name}: {info[name]['rss_mib']:.0f} MiB resident")
    return servers, info


def run(args: argparse.Namespace, servers: dict[str, Server]) -> dict[str, Any]:
    names = list(servers)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    ttfts: dict[str, list[float]] = {name: [] for name in names}
    per_round: list[dict[str, Any]] = []
    refused: dict[str, Counter[str]] = {name: Counter() for name in names}
    log("warm-up")
    for name, server in servers.items():
        sequential(server.url, 0, args.warmup, refused[name])
        asyncio.run(bursts(server.url, 0, 0, args.burst, args.burst_tokens, refused[name]))
    total = args.rounds * len(names) * (args.sequential + args.burst)
    with tqdm(total=total, desc="requests", unit="req") as bar:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            found: dict[str, Any] = {"round": r, "order": order}
            for name in order:
                url = servers[name].url
                first = 1_000_000 * (r + 1)
                seq = sequential(url, first, args.sequential, refused[name])
                bar.update(args.sequential)
                first_burst = first + args.sequential
                got = asyncio.run(
                    bursts(url, first_burst, 1, args.burst, args.burst_tokens, refused[name])
                )
                bar.update(args.burst)
                latencies[name] += seq
                ttfts[name] += got
                found[name] = {
                    "sequential_p50_s": percentile(seq, 50),
                    "burst_ttft_p50_s": percentile(got, 50),
                }
            per_round.append(found)
            summary = ", ".join(
                f"{n} {fmt_ms(found[n]['sequential_p50_s'])}/{fmt_ms(found[n]['burst_ttft_p50_s'])}"
                for n in names
            )
            tqdm.write(
                f"round {r + 1}/{args.rounds} (sequential p50 / burst TTFT p50, ms): {summary}"
            )
    figures: dict[str, dict[str, Any]] = {
        name: {
            "sequential_p50_s": percentile(latencies[name], 50),
            "sequential_p99_s": percentile(latencies[name], 99),
            "burst_ttft_p50_s": percentile(ttfts[name], 50),
            "burst_ttft_p99_s": percentile(ttfts[name], 99),
            "num_sequential": len(latencies[name]),
            "num_burst": len(ttfts[name]),
            "refused": dict(refused[name]),  # by status, warm-up included
        }
        for name in names
    }
    many, one, plain = names[2], names[1], names[0]
    keys = ("sequential_p50_s", "sequential_p99_s", "burst_ttft_p50_s")
    return {
        "figures": figures,
        "ratios": {
            f"{many} / {one}": {k: figures[many][k] / figures[one][k] for k in keys},
            f"{one} / {plain}": {k: figures[one][k] / figures[plain][k] for k in keys},
        },
        "per_round": per_round,
        "latencies_s": latencies,
        "ttfts_s": ttfts,
    }


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    for name, values in result["latencies_s"].items():
        ms = sorted(v * 1000 for v in values)
        left.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=name)
    left.set_xscale("log")
    left.set_xlabel("latency of a non-streamed request, max_tokens 1 (ms)")
    left.set_ylabel("share of requests")
    left.set_title("sequential requests")
    left.legend(loc="lower right")
    names = list(result["ttfts_s"])
    right.boxplot(
        [[v * 1000 for v in result["ttfts_s"][n]] for n in names], tick_labels=names, whis=(1, 99)
    )
    right.set_ylabel("TTFT (ms); whiskers p1..p99")
    right.set_title(f"bursts of {result['burst_size']} streams at once")
    ratio = next(iter(result["ratios"].values()))
    fig.suptitle(
        f"{names[2]} / {names[1]}: sequential p50 {ratio['sequential_p50_s']:.2f}x, "
        f"p99 {ratio['sequential_p99_s']:.2f}x, burst TTFT p50 {ratio['burst_ttft_p50_s']:.2f}x"
    )
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--replicas", type=int, default=16, help="replicas of the larger fleet")
    add("--rounds", type=int, default=5, help="rounds; each server takes its share in each")
    add("--sequential", type=int, default=60, help="sequential requests a server, a round")
    add("--burst", type=int, default=32, help="streamed requests sent at once, a burst")
    add("--burst-tokens", type=int, default=8, help="max_tokens of a burst's streams")
    add("--warmup", type=int, default=20, help="sequential requests a server before the rounds")
    add("--start-timeout", type=float, default=600, help="seconds for a server to start")
    add("--num-threads", type=int, default=1, help="torch threads a replica (kept at 1)")
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    start = RunStart.now()
    available = mem_available_mib()
    fits = int((available - 4096) // MIB_PER_REPLICA)
    log(f"{available:.0f} MiB available: room for about {fits} fixed-runner replicas")
    if args.replicas > fits:
        log(f"warning: --replicas {args.replicas} may not fit; --replicas {fits} would")
    with (
        tempfile.TemporaryDirectory(prefix="tokenfleet-fleet-overhead-") as tmp_name,
        ExitStack() as stack,
    ):
        servers, info = start_servers(stack, args, Path(tmp_name))
        result = run(args, servers)
    result["servers"] = info
    result["burst_size"] = args.burst
    result["replica_timeout_s"] = REPLICA_TIMEOUT_S

    header = ["server", "replicas", "seq p50 ms", "seq p99 ms", "burst TTFT p50 ms", "refused"]
    rows = [[*header, "MiB", "start s"]]
    for name, f in result["figures"].items():
        rows.append(
            [
                name,
                str(info[name]["replicas"] or "- (no Ray)"),
                f"{f['sequential_p50_s'] * 1000:.2f}",
                f"{f['sequential_p99_s'] * 1000:.2f}",
                fmt_ms(f["burst_ttft_p50_s"]),
                str(sum(f["refused"].values())),
                f"{info[name]['rss_mib']:.0f}",
                f"{info[name]['start_s']:.0f}",
            ]
        )
    print(format_table(rows))
    rows = [["ratio", "seq p50", "seq p99", "burst TTFT p50"]]
    for label, r in result["ratios"].items():
        rows.append(
            [label]
            + [f"{r[k]:.2f}x" for k in ("sequential_p50_s", "sequential_p99_s", "burst_ttft_p50_s")]
        )
    print(format_table(rows))
    out = start.provenance(args) | {"args": args_json(args), **result}
    write_result(args.out, RESULT_NAME, out, lambda path: plot(path, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
