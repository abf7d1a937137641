"""Mixed load: interactive streams at ~30% of capacity beside a saturating batch, on this
CPU with the bundled model, tokenfleet's priority policy against FCFS and the peers.

    calibrate ─► (a) interactive alone ─► (b) batch alone ─► (c) both, priority
              ─► (d) both, fcfs ─► (e) each peer, both       (a fresh server for each)

Calibration, on a fresh `tokenfleet serve` (priority policy, --num-threads, a temporary
--data-dir): the single-stream decode step (median TPOT of greedy streams), the prefill
rate (median TTFT of a ~1,000-token prompt alone), and a closed-loop probe at the
workload's mean lengths (1, 2, 4, ... concurrent streams; capacity = the most requests/s
of a level whose TPOT p90 and TTFT p90 stay within the targets). Then

    TPOT target = 2 x the single-stream decode step
    TTFT target = 2 x the TTFT of the workload's p90 prompt alone (p90 / prefill rate)
    interactive rate = --load x capacity (default 0.3)

and every tokenfleet server of the run is started with --tpot-target / --ttft-target.
Each configuration runs the same seeded `tokenfleet bench` workload (ignore_eos,
lognormal lengths capped to --max-model-len). Batch tokens/s is counted over the
interactive window [0, duration] (the batch is sized to outlast it): from the server's
per-class token counters (/metrics) for the Batch API, from the streamed tokens for
concurrent batch streams (the peers); and over its steady part, after the first minute
(what a 24-hour batch sees: a batch of 64 requests in flight first prefills them all, 8
streams hardly wait). Ratios: interactive TPOT p99 (c)/(a) (goal <= 1.2)
and batch tokens/s (c)/(b) (goal >= 0.6); (d) likewise against (a) and (b).

    .venv/bin/python bench/mixed_load.py                          # everything (about an hour)
    .venv/bin/python bench/mixed_load.py --quick --configs a,b,c  # a smoke run (~5 minutes)

Writes mixed_load.json and mixed_load.png into --out (bench/results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from common.calibration import Calibration, calibrate
from common.log import log
from common.results import RunStart, args_json, fmt_ms, format_table, write_result
from common.server import Server, peer_server, tokenfleet_server

from tokenfleet.loadgen.run import BenchConfig, BenchResult, run_bench
from tokenfleet.loadgen.workload import WorkloadConfig

RESULT_NAME = "mixed_load"
HERE = Path(__file__).resolve().parent
PEERS = ("vllm", "llama-q4_1", "llama-f32")
# The harvest margin of configuration c2: a step limit of 0.6 x the TPOT target, which is
# 1.2 x the single-stream decode step when the target is 2 x that step, the ratio.
TIGHT_MARGIN = 0.4
# Configuration c3: a step limit of one single-stream decode step (0.5 x a target of 2 x
# that step), so that batch joins a step beside streams only where it costs them nothing
# the model can see, and fills the time between them.
STREAMS_FIRST_MARGIN = 0.5
# Configuration m: the TPOT target a peer reached (its measured p50), and steps of batch
# alone kept within this share of the TTFT target, since an interactive arrival waits for
# the step in progress (a 512-token step of batch prefill is most of a second here).
BATCH_STEP_TTFT_SHARE = 0.2
OURS = {  # config: (policy, interactive?, batch?, extra serve arguments)
    "a": ("priority", True, False, []),
    "b": ("priority", False, True, []),
    "c": ("priority", True, True, []),
    "c2": ("priority", True, True, ["--harvest-margin", str(TIGHT_MARGIN)]),
    "c3": ("priority", True, True, ["--harvest-margin", str(STREAMS_FIRST_MARGIN)]),
    "d": ("fcfs", True, True, []),
    # (c) with the engine's overlap on and off (EngineConfig.overlap), side by side
    "con": ("priority", True, True, ["--overlap", "on"]),
    "coff": ("priority", True, True, ["--overlap", "off"]),
    # the priority policy with its TPOT target set to a peer's measured TPOT p50 (--match)
    # and --batch-step-limit BATCH_STEP_TTFT_SHARE x the TTFT target
    "m": ("priority", True, True, []),
}
LABELS = {
    "a": "(a) interactive alone",
    "b": "(b) batch alone",
    "c": "(c) mixed, priority",
    "c2": f"(c2) mixed, priority, margin {TIGHT_MARGIN}",
    "c3": f"(c3) mixed, priority, margin {STREAMS_FIRST_MARGIN}",
    "d": "(d) mixed, fcfs",
    "con": "(c) mixed, priority, overlap on",
    "coff": "(c) mixed, priority, overlap off",
    "m": "(m) mixed, priority, TPOT target = a peer's TPOT p50",
}
# The interactive percentiles "equal or better" compares, TTFT and TPOT alike.
PERCENTILES = ("p50", "p90", "p99")
GOAL_TPOT_RATIO = 1.2
GOAL_BATCH_RATIO = 0.6
_BATCH_COUNT = re.compile(
    r'^tokenfleet_time_(?:to_first_token|per_output_token)_seconds_count\{[^}]*priority="batch"'
    r"[^}]*\}\s+(\S+)$",
    re.MULTILINE,
)


def peer_key(key: str) -> tuple[str, int | None] | None:
    """A peer configuration's peer and batch streams ("vllm": the default number, "vllm@2":
    2); None for one of ours or a key that is neither."""
    name, at, streams = key.partition("@")
    if name not in PEERS or (at and not (streams.isdigit() and int(streams) > 0)):
        return None
    return name, int(streams) if at else None


def peer_name(key: str) -> str | None:
    peer = peer_key(key)
    return None if peer is None else peer[0]


def peer_batch_streams(key: str, args: argparse.Namespace) -> int:
    peer = peer_key(key)
    assert peer is not None, key
    return int(args.peer_batch_concurrency) if peer[1] is None else peer[1]


def config_order(key: str) -> tuple[int, int]:
    """Ours in OURS's order, then the peers, each by its batch streams."""
    if key in OURS:
        return (list(OURS).index(key), 0)
    peer = peer_key(key)
    assert peer is not None, key
    return (len(OURS) + PEERS.index(peer[0]), peer[1] or 0)


# -- one configuration --------------------------------------------------------------------


def _batch_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in _BATCH_COUNT.findall(text))


def steady_after_s(duration_s: float) -> float:
    """Where the steady part of the window starts: the batch's first minute (its first
    requests' prefills, before any of them gives tokens) left out, a fifth of shorter runs."""
    return min(60.0, duration_s / 5)


async def _bench_windowed(
    config: BenchConfig, metrics_url: str | None
) -> tuple[BenchResult, tuple[float, float, float, float] | None]:
    """The bench run, plus the batch tokens the server counted during [0, duration] and
    during its steady part [steady_after_s, duration], each with its measured span."""
    window = config.workload.duration_s
    warm = steady_after_s(window)

    async def counted() -> tuple[float, float, float, float] | None:
        if metrics_url is None:
            await asyncio.sleep(window)
            return None
        t0, before = time.perf_counter(), await asyncio.to_thread(_batch_tokens, metrics_url)
        await asyncio.sleep(warm)
        t1, middle = time.perf_counter(), await asyncio.to_thread(_batch_tokens, metrics_url)
        await asyncio.sleep(max(window - (t1 - t0), 0.0))
        t2, after = time.perf_counter(), await asyncio.to_thread(_batch_tokens, metrics_url)
        return after - before, t2 - t0, after - middle, t2 - t1

    result, tokens = await asyncio.gather(run_bench(config), counted())
    return result, tokens


def run_config(
    key: str,
    server: Server,
    args: argparse.Namespace,
    workload: WorkloadConfig,
    cal: Calibration,
    num_batch: int,
    tmp: Path,
    tpot_target_s: float,
) -> dict[str, Any]:
    peer = peer_name(key) is not None
    interactive, batch = (True, True) if peer else OURS[key][1:3]
    config = BenchConfig(
        url=server.url,
        out=tmp / f"bench-{key}",
        batch_mode="concurrent" if peer else "api",
        batch_concurrency=peer_batch_streams(key, args) if peer else args.peer_batch_concurrency,
        batch_priority=None,  # peers run FCFS (vLLM refuses `priority` without the policy)
        ttft_target_s=cal.ttft_target_s,
        tpot_target_s=cal.tpot_target_s,  # goodput: against the calibrated targets always
        drain_s=args.drain,
        progress=False,
        workload=replace(
            workload, rate=cal.rate_rps if interactive else 0.0, num_batch=num_batch if batch else 0
        ),
    )
    log(
        f"{LABELS.get(key, key)}: {config.workload.rate:.3f} interactive req/s for "
        f"{workload.duration_s:.0f} s, {config.workload.num_batch} batch requests "
        f"({config.batch_mode if batch else 'none'}); "
        f"up to {workload.duration_s + args.drain:.0f} s"
    )
    result, tokens = asyncio.run(_bench_windowed(config, None if peer else server.url))
    summary = {s.kind: asdict(s) for s in result.summaries}
    if tokens is None:  # streamed: the tokens that arrived within the window, and its part
        window = workload.duration_s
        warm = steady_after_s(window)
        times = [t for r in result.records if r.kind == "batch" for t in r.token_times_s]
        tokens = (
            sum(t <= window for t in times),
            window,
            sum(warm < t <= window for t in times),
            window - warm,
        )
    counted, span, counted_steady, span_steady = tokens
    inter = [r for r in result.records if r.kind == "interactive" and r.status == "ok"]
    if peer:
        label = f"(e) {peer_name(key)}, {peer_batch_streams(key, args)} batch streams"
    elif key == "m":
        label = (
            f"(m) mixed, priority, TPOT target {1e3 * tpot_target_s:.0f} ms ({args.match}'s "
            f"p50), batch steps <= {1e3 * args.m_step_share * cal.ttft_target_s:.0f} ms"
        )
        if args.m_harvest_margin is not None:
            label += f", margin {args.m_harvest_margin}"
    else:
        label = LABELS[key]
    row = {
        "config": key,
        "label": label,
        "server": server.name,
        "batch_mode": result.batch_mode if batch else "none",
        "interactive": summary["interactive"],
        "batch": summary["batch"],
        "batch_tokens_in_window": counted if batch else None,
        "batch_tokens_per_s": counted / span if batch else None,
        "batch_tokens_per_s_steady": counted_steady / span_steady if batch else None,
        "batch_ended_in_window": bool(
            result.batch_job
            and result.batch_job.done_s is not None
            and result.batch_job.done_s < workload.duration_s
        ),
        "interactive_ttft_s": sorted(t for r in inter if (t := r.ttft_s) is not None),
        "interactive_tpot_s": sorted(t for r in inter if (t := r.tpot_s) is not None),
    }
    if row["batch_ended_in_window"]:
        log(f"warning: {key}'s batch ended inside the window: raise --num-batch")
    row["tpot_target_s"] = tpot_target_s if not peer else None
    log(f"{key} done: " + describe(row))
    return row


def describe(row: dict[str, Any]) -> str:
    i = row["interactive"]
    parts = []
    if i["num_requests"]:
        parts.append(
            f"interactive {i['num_ok']}/{i['num_requests']} ok, {i['num_refused']} "
            f"refused, TPOT p99 {fmt_ms(i['tpot_s']['p99'])} ms, TTFT p99 "
            f"{fmt_ms(i['ttft_s']['p99'])} ms"
        )
    if row["batch_tokens_per_s"] is not None:
        parts.append(
            f"batch {row['batch_tokens_per_s']:.1f} tokens/s "
            f"({row['batch_tokens_per_s_steady']:.1f} after the first minute)"
        )
    return "; ".join(parts)


# -- the report ---------------------------------------------------------------------------


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mixed configuration: TPOT p99 against (a), batch tokens/s against (b)."""
    out = {}
    alone = rows.get("a", {}).get("interactive", {}).get("tpot_s", {}).get("p99")
    batch_alone = rows.get("b", {}).get("batch_tokens_per_s")
    for key, row in rows.items():
        if key in ("a", "b"):
            continue
        tpot = row["interactive"]["tpot_s"]["p99"]
        tps = row["batch_tokens_per_s"]
        tpot_ratio = tpot / alone if tpot is not None and alone else None
        batch_ratio = tps / batch_alone if tps is not None and batch_alone else None
        out[key] = {
            "tpot_p99_ratio": tpot_ratio,
            "tpot_goal_met": None if tpot_ratio is None else tpot_ratio <= GOAL_TPOT_RATIO,
            "batch_tps_ratio": batch_ratio,
            "batch_goal_met": None if batch_ratio is None else batch_ratio >= GOAL_BATCH_RATIO,
        }
    return out


def versus_peers(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per peer configuration: which of tokenfleet's mixed configurations did more batch
    tokens/s at equal or better interactive percentiles (TTFT and TPOT p50, p90 and p99,
    each <= the peer's), and so whether the issue's goal holds against that peer run."""
    ours = [k for k in rows if k in OURS and k not in ("a", "b")]
    out = {}
    for key, peer in rows.items():
        if peer_name(key) is None or peer["batch_tokens_per_s"] is None:
            continue
        better = []
        for k in ours:
            row = rows[k]
            if row["batch_tokens_per_s"] is None:
                continue
            latency_ok = all(
                row["interactive"][f][p] is not None
                and peer["interactive"][f][p] is not None
                and row["interactive"][f][p] <= peer["interactive"][f][p]
                for f in ("ttft_s", "tpot_s")
                for p in PERCENTILES
            )
            if latency_ok and row["batch_tokens_per_s"] > peer["batch_tokens_per_s"]:
                better.append(k)
        out[key] = {"ours_better": better, "goal_met": bool(better)}
    return out


def versus_table(rows: dict[str, dict[str, Any]], versus: dict[str, dict[str, Any]]) -> str:
    lines = [["peer configuration", "batch tok/s", "ours with more, at <= every percentile"]]
    for key, v in versus.items():
        better = ", ".join(f"{k} ({rows[k]['batch_tokens_per_s']:.1f})" for k in v["ours_better"])
        lines.append(
            [rows[key]["label"], f"{rows[key]['batch_tokens_per_s']:.1f}", better or "none"]
        )
    return format_table(lines)


def table(rows: dict[str, dict[str, Any]], rats: dict[str, dict[str, Any]]) -> str:
    head = [
        "configuration",
        "TTFT ms p50/p90/p99",
        "TPOT ms p50/p90/p99",
        "ok/sent",
        "refused",
        "goodput",
        "batch tok/s",
        "after 1st min",
        "TPOT p99 / (a)",
        "batch / (b)",
    ]
    lines = [head]
    for key, row in rows.items():
        i = row["interactive"]
        has = i["num_requests"] > 0
        r = rats.get(key, {})
        lines.append(
            [
                row["label"],
                "/".join(fmt_ms(i["ttft_s"][p]) for p in ("p50", "p90", "p99")) if has else "-",
                "/".join(fmt_ms(i["tpot_s"][p]) for p in ("p50", "p90", "p99")) if has else "-",
                f"{i['num_ok']}/{i['num_requests']}" if has else "-",
                str(i["num_refused"]) if has else "-",
                f"{i['goodput']:.0%}" if has and i["goodput"] is not None else "-",
                "-" if row["batch_tokens_per_s"] is None else f"{row['batch_tokens_per_s']:.1f}",
                _steady(row),
                _ratio(r.get("tpot_p99_ratio"), "<=", GOAL_TPOT_RATIO),
                _ratio(r.get("batch_tps_ratio"), ">=", GOAL_BATCH_RATIO),
            ]
        )
    return format_table(lines)


def _steady(row: dict[str, Any]) -> str:
    value = row.get("batch_tokens_per_s_steady")  # (rows of runs before it lack it)
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None, op: str, goal: float) -> str:
    if value is None:
        return "-"
    met = value <= goal if op == "<=" else value >= goal
    return f"{value:.2f} ({'met' if met else 'not met'})"


def plot(path: Path, rows: dict[str, dict[str, Any]], cal: Calibration) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    keys = list(rows)
    xs = range(len(keys))
    ax = axes[0][0]
    width = 0.4
    for offset, (name, field) in zip(
        (-width / 2, width / 2), (("TPOT p99", "tpot_s"), ("TTFT p99 / 10", "ttft_s")), strict=True
    ):
        scale = 1000 if field == "tpot_s" else 100
        values = [(rows[k]["interactive"][field]["p99"] or 0.0) * scale for k in keys]
        ax.bar([x + offset for x in xs], values, width, label=name)
    ax.axhline(cal.tpot_target_s * 1000, color="grey", ls="--", label="TPOT target")
    ax.set_xticks(list(xs), keys)
    ax.set_ylabel("ms")
    ax.set_title("interactive p99 by configuration")
    ax.legend()
    ax = axes[0][1]
    ax.bar(list(xs), [rows[k]["batch_tokens_per_s"] or 0.0 for k in keys], color="tab:green")
    ax.set_xticks(list(xs), keys)
    ax.set_ylabel("batch output tokens/s (interactive window)")
    ax.set_title("batch throughput by configuration")
    for ax, field, target in (
        (axes[1][0], "interactive_tpot_s", cal.tpot_target_s),
        (axes[1][1], "interactive_ttft_s", cal.ttft_target_s),
    ):
        for key in keys:
            values = rows[key][field]
            if values:
                ys = [n / len(values) for n in range(len(values) + 1)]  # from 0 at the first
                xs_ms = [v * 1000 for v in values[:1] + values]
                ax.step(xs_ms, ys, where="post", label=rows[key]["label"])
        ax.axvline(target * 1000, color="grey", ls="--", label="target")
        ax.set_xlabel(f"interactive {field[-6:-2].upper()} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"interactive {field[-6:-2].upper()} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--configs",
        default="a,b,c,c2,c3,d,e",
        help="a: interactive alone, b: batch alone, c: mixed priority, c2 and c3: c with "
        f"harvest margin {TIGHT_MARGIN} and {STREAMS_FIRST_MARGIN}, con and coff: c with "
        "the overlap on and off, d: mixed fcfs, "
        "m: mixed priority with the TPOT target set to --match's measured TPOT p50 and "
        f"batch steps within {BATCH_STEP_TTFT_SHARE} x the TTFT target, "
        f"e: every installed peer, or a peer by name ({', '.join(PEERS)}), with @N for N "
        "batch streams (vllm@2; default --peer-batch-concurrency)",
    )
    add(
        "--match",
        default="vllm",
        help="config m: the peer configuration whose interactive TPOT p50 becomes "
        "tokenfleet's --tpot-target (run earlier in this run, or in --rerun's file)",
    )
    add(
        "--m-step-share",
        type=float,
        default=BATCH_STEP_TTFT_SHARE,
        help="config m: --batch-step-limit as this share of the TTFT target (%(default)s)",
    )
    add(
        "--m-harvest-margin",
        type=float,
        help="config m: --harvest-margin (default: the server's, 0.1)",
    )
    add("--quick", action="store_true", help="short durations and probes (a smoke run)")
    add("--duration", type=float, help="seconds of interactive arrivals (300; quick 30)")
    add("--drain", type=float, help="seconds after --duration (60; quick 15)")
    add("--load", type=float, default=0.3, help="interactive rate, share of capacity")
    add("--num-threads", type=int, default=1, help="engine threads (tokenfleet and peers)")
    add("--max-model-len", type=int, default=2048, help="context cap (servers and lengths)")
    add("--prompt-len-median", type=int, default=128)
    add("--output-len-median", type=int, default=32)
    add("--length-tail", type=float, default=1.0, help="lognormal sigma")
    add("--seed", type=int, default=0)
    add("--num-batch", type=int, help="batch requests (default: enough to outlast the run)")
    add("--peer-batch-concurrency", type=int, default=8, help="peers: batch streams in flight")
    add("--prefill-probe-len", type=int, default=1000, help="prompt tokens for the prefill rate")
    add("--probe-s", type=float, help="seconds per capacity probe level (20; quick 8)")
    add("--out", type=Path, default=Path("bench/results"))
    add(
        "--rerun",
        type=Path,
        help="an earlier mixed_load.json: run --configs again with its calibration and "
        "workload, and write it back with their rows replaced",
    )
    args = parser.parse_args(argv)
    args.duration = args.duration or (30.0 if args.quick else 300.0)
    args.drain = args.drain if args.drain is not None else (15.0 if args.quick else 60.0)
    args.probe_s = args.probe_s or (8.0 if args.quick else 20.0)
    args.probe_levels = (1, 2, 4) if args.quick else (1, 2, 4, 8, 16)
    keys = []
    for key in args.configs.split(","):
        key = key.strip()
        if key == "e":
            keys += [p for p in PEERS if p not in keys]
        elif key in OURS or peer_key(key) is not None:
            keys.append(key)
        else:
            parser.error(f"unknown configuration {key!r}")
    args.keys = keys
    return args


def peer_installed(key: str) -> bool:
    name = peer_name(key)
    if name == "vllm":
        return (HERE / "peers" / "vllm-venv" / "bin" / "vllm").exists()
    return (HERE / "peers" / "build" / "llama.cpp-build" / "bin" / "llama-server").exists()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    start = RunStart.now()
    workload = WorkloadConfig(
        duration_s=args.duration,
        max_model_len=args.max_model_len,
        prompt_len_median=args.prompt_len_median,
        output_len_median=args.output_len_median,
        length_tail=args.length_tail,
        seed=args.seed,
    )
    rows: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    earlier = json.loads(args.rerun.read_text()) if args.rerun else None
    with tempfile.TemporaryDirectory(prefix="tokenfleet-mixed-") as tmp_name:
        tmp = Path(tmp_name)
        if earlier is not None:  # the same calibration and workload as that run
            cal = Calibration(**earlier["calibration"])
            log(f"calibration and workload of {args.rerun} ({earlier['date']})")
        else:
            with tokenfleet_server(args, tmp, "calibration", "priority", None) as server:
                cal = calibrate(server.url, args, workload)
        # enough batch work for the whole run even at 20x the single-stream token rate
        num_batch = args.num_batch or math.ceil(
            20 / cal.decode_step_s * (args.duration + args.drain) / cal.mean_output_len
        )
        if earlier is not None:
            num_batch = earlier["workload"]["num_batch"]
        log(
            f"capacity {cal.capacity_rps:.2f} req/s; interactive rate {cal.rate_rps:.3f} req/s;"
            f" batch {num_batch} requests"
        )
        for key in args.keys:
            peer = peer_name(key)
            if peer is not None and not peer_installed(key):
                skipped[key] = "not installed (bench/peers/install-*)"
                log(f"skipping {key}: {skipped[key]}")
                continue
            tpot_target_s = cal.tpot_target_s
            if key == "m":
                matched = rows.get(args.match) or (earlier or {}).get("configs", {}).get(args.match)
                if matched is None or matched["interactive"]["tpot_s"]["p50"] is None:
                    raise SystemExit(f"m: no measured TPOT p50 of {args.match!r} to match")
                tpot_target_s = matched["interactive"]["tpot_s"]["p50"]
                log(f"m: TPOT target {1e3 * tpot_target_s:.1f} ms, {args.match}'s p50")
            try:
                if peer is not None:
                    context = peer_server(args, tmp, peer)
                else:
                    policy, _, _, extra = OURS[key]
                    if key == "m":
                        limit = args.m_step_share * cal.ttft_target_s
                        extra = [*extra, "--batch-step-limit", f"{limit:.4f}"]
                        if args.m_harvest_margin is not None:
                            extra += ["--harvest-margin", str(args.m_harvest_margin)]
                    targets = (cal.ttft_target_s, tpot_target_s)
                    context = tokenfleet_server(args, tmp, key, policy, targets, extra)
                with context as server:
                    rows[key] = run_config(
                        key, server, args, workload, cal, num_batch, tmp, tpot_target_s
                    )
            except (RuntimeError, TimeoutError) as exc:
                if peer is None:
                    raise
                skipped[key] = str(exc)[:500]
                log(f"skipping {key}: it did not start ({str(exc)[:200]})")
    reran: dict[str, str] = {}
    if earlier is not None:  # this run's rows replace that run's, the others are kept
        reran = dict.fromkeys(rows, start.started_at.isoformat(timespec="seconds"))
        reran = earlier.get("reran", {}) | reran
        rows = {k: v for k, v in earlier["configs"].items() if k not in rows} | rows
        rows = dict(sorted(rows.items(), key=lambda kv: config_order(kv[0])))
        skipped = {k: v for k, v in earlier.get("skipped", {}).items() if k not in rows} | skipped
    rats = ratios(rows)
    versus = versus_peers(rows)
    print(table(rows, rats))
    if versus:
        print()
        print("the goal, peer by peer: more batch tokens/s at equal or better interactive")
        print("TTFT and TPOT p50/p90/p99 (each <= the peer's)")
        print(versus_table(rows, versus))
    result = start.provenance(args) | {
        "quick": args.quick,
        "args": args_json(args),
        "workload": asdict(workload) | {"num_batch": num_batch, "rate": cal.rate_rps},
        "calibration": asdict(cal),
        "goals": {"tpot_p99_ratio_max": GOAL_TPOT_RATIO, "batch_tps_ratio_min": GOAL_BATCH_RATIO},
        "ratios": rats,
        "versus_peers": versus,
        "configs": rows,
        "skipped": skipped,
        "reran": reran,  # configurations run again later (--rerun), and when
    }
    if earlier is not None:
        result |= {k: earlier[k] for k in ("command", "date", "machine", "args", "workload")}
        result["rerun_command"] = shlex.join([sys.executable, *sys.argv])
    write_result(args.out, RESULT_NAME, result, lambda path: plot(path, rows, cal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
