"""Interactive overload beside a running batch: does admission control refuse before TTFT
p99 breaks its target, and does every batch request still end with exactly one result?

    one tokenfleet server per mode (admission on: the calibrated --ttft-target; off: 3600 s)
      t=0  a batch of --num-batch requests through the Anthropic Batch API
      then interactive Poisson arrivals at each level (x capacity), --level-s seconds each
      end  cancel the batch, wait for it to end, read every result line

The targets, the capacity and the workload's lengths come from the calibration of
bench/mixed_load.py (its JSON, --calibration); without one the calibration runs first.
Per level: sent, refused (429/529), TTFT and TPOT p50/p99 of the answered requests,
goodput. The batch check: one result line per submitted custom_id, none twice, none
missing, each succeeded or canceled.

    .venv/bin/python bench/overload.py                 # about 15 minutes
    .venv/bin/python bench/overload.py --level-s 20 --levels 1,4 --modes on   # quick

Writes overload.json and overload.png into --out (bench/results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from common.calibration import Calibration, calibrate
from common.log import log
from common.results import RunStart, args_json, fmt_ms, format_table, write_result
from common.server import tokenfleet_server

from tokenfleet.loadgen.client import Endpoint
from tokenfleet.loadgen.run import BenchConfig, run_bench
from tokenfleet.loadgen.workload import WorkloadConfig, build_workload, prompt_text

RESULT_NAME = "overload"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--calibration", type=Path, default=Path("bench/results/mixed_load.json"))
    add("--levels", default="0.5,1,2,4", help="interactive rates, times the capacity")
    add("--level-s", type=float, default=90.0, help="seconds of arrivals per level")
    add("--drain", type=float, default=30.0, help="seconds after each level")
    add("--modes", default="on,off", help="admission control on, off, or both")
    add("--num-batch", type=int, default=200)
    add("--num-threads", type=int, default=1)
    add("--max-model-len", type=int, default=2048)
    add("--prompt-len-median", type=int, default=128)
    add("--output-len-median", type=int, default=32)
    add("--length-tail", type=float, default=1.0, help="lognormal sigma")
    add("--seed", type=int, default=0)
    add("--out", type=Path, default=Path("bench/results"))
    # What calibrate() reads when there is no calibration file.
    add("--quick", action="store_true", help=argparse.SUPPRESS)
    add("--prefill-probe-len", type=int, default=1000, help=argparse.SUPPRESS)
    add("--load", type=float, default=0.3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.probe_s, args.probe_levels = 20.0, (1, 2, 4, 8, 16)
    args.level_factors = [float(x) for x in args.levels.split(",")]
    args.mode_list = [m.strip() for m in args.modes.split(",")]
    if not set(args.mode_list) <= {"on", "off"}:
        parser.error("--modes takes on, off or on,off")
    return args


def load_calibration(args: argparse.Namespace, workload: WorkloadConfig, tmp: Path) -> Calibration:
    if args.calibration.exists():
        data = json.loads(args.calibration.read_text())
        log(f"calibration from {args.calibration} ({data['date']})")
        return Calibration(**data["calibration"])
    with tokenfleet_server(args, tmp, "calibration", "priority", None) as server:
        return calibrate(server.url, args, workload)


async def submit_batch(url: str, workload: WorkloadConfig, num_batch: int) -> str:
    specs = build_workload(replace(workload, rate=0.0, num_batch=num_batch))
    async with httpx.AsyncClient(timeout=120) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        endpoint = Endpoint(url, "anthropic", model, None, True)
        requests = [
            {
                "custom_id": s.req_id,
                "params": endpoint.body(s, prompt_text(workload, s), stream=False),
            }
            for s in specs
        ]
        response = await http.post(f"{url}/v1/messages/batches", json={"requests": requests})
        response.raise_for_status()
        return str(response.json()["id"])


async def end_batch(url: str, batch_id: str, num_batch: int) -> dict[str, Any]:
    """Cancel, wait for the end, and check every custom_id has exactly one result."""
    async with httpx.AsyncClient(timeout=120) as http:
        (await http.post(f"{url}/v1/messages/batches/{batch_id}/cancel")).raise_for_status()
        while True:
            batch = (await http.get(f"{url}/v1/messages/batches/{batch_id}")).json()
            if batch["processing_status"] == "ended":
                break
            await asyncio.sleep(1)
        response = await http.get(f"{url}/v1/messages/batches/{batch_id}/results")
        response.raise_for_status()
    lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    ids = Counter(line["custom_id"] for line in lines)
    expected = {f"b-{i:06d}" for i in range(num_batch)}
    types = Counter(line["result"]["type"] for line in lines)
    return {
        "request_counts": batch["request_counts"],
        "result_lines": len(lines),
        "result_types": dict(types),
        "missing": sorted(expected - ids.keys()),
        "duplicated": sorted(i for i, n in ids.items() if n > 1),
        "unexpected": sorted(ids.keys() - expected),
        "every_request_one_result": ids.keys() == expected and max(ids.values()) == 1,
    }


def run_mode(
    mode: str, args: argparse.Namespace, cal: Calibration, workload: WorkloadConfig, tmp: Path
) -> dict[str, Any]:
    ttft_target = cal.ttft_target_s if mode == "on" else 3600.0
    targets = (ttft_target, cal.tpot_target_s)
    levels = []
    with tokenfleet_server(args, tmp, f"admission-{mode}", "priority", targets) as server:
        batch_id = asyncio.run(submit_batch(server.url, workload, args.num_batch))
        log(f"admission {mode}: batch {batch_id} of {args.num_batch} requests submitted")
        for i, factor in enumerate(args.level_factors):
            rate = factor * cal.capacity_rps
            config = BenchConfig(
                url=server.url,
                out=tmp / f"bench-{mode}-{i}",
                batch_mode="none",
                ttft_target_s=cal.ttft_target_s,
                tpot_target_s=cal.tpot_target_s,
                drain_s=args.drain,
                progress=False,
                workload=replace(
                    workload, rate=rate, duration_s=args.level_s, num_batch=0, seed=args.seed + i
                ),
            )
            result = asyncio.run(run_bench(config))
            summary = next(s for s in result.summaries if s.kind == "interactive")
            row = {"factor": factor, "rate_rps": rate} | asdict(summary)
            levels.append(row)
            log(f"admission {mode}, {factor:g}x capacity ({rate:.3f} req/s): " + describe(row))
        batch = asyncio.run(end_batch(server.url, batch_id, args.num_batch))
        log(
            f"admission {mode}: batch {batch['result_types']}, one result each: "
            f"{batch['every_request_one_result']}"
        )
    return {"mode": mode, "ttft_target_s": ttft_target, "levels": levels, "batch": batch}


def describe(row: dict[str, Any]) -> str:
    ttft, tpot = row["ttft_s"], row["tpot_s"]
    return (
        f"{row['num_requests']} sent, {row['num_refused']} refused, {row['num_ok']} answered,"
        f" {row['num_unfinished']} unfinished; TTFT p50/p99 "
        f"{fmt_ms(ttft['p50'])}/{fmt_ms(ttft['p99'])}"
        f" ms, TPOT p99 {fmt_ms(tpot['p99'])} ms, goodput "
        + ("-" if row["goodput"] is None else f"{row['goodput']:.0%}")
    )


def verdict(result: dict[str, Any], ttft_target_s: float) -> dict[str, Any]:
    """The first level with refusals and the first whose TTFT p99 is over the target."""
    first_refusal = first_break = None
    for row in result["levels"]:
        p99 = row["ttft_s"]["p99"]
        if first_refusal is None and row["num_refused"] > 0:
            first_refusal = row["factor"]
        broke = (p99 is not None and p99 > ttft_target_s) or row["num_unfinished"] > 0
        if first_break is None and broke:
            first_break = row["factor"]
    return {
        "first_refusal_at": first_refusal,
        "first_ttft_p99_break_at": first_break,
        "refusals_before_break": first_refusal is not None
        and (first_break is None or first_refusal <= first_break),
    }


def table(results: list[dict[str, Any]], cal: Calibration) -> str:
    lines = [
        [
            "admission",
            "load",
            "req/s",
            "sent",
            "refused",
            "answered",
            "unfinished",
            "TTFT ms p50/p99",
            "TPOT ms p50/p99",
            "goodput",
        ]
    ]
    for result in results:
        for row in result["levels"]:
            ttft, tpot = row["ttft_s"], row["tpot_s"]
            lines.append(
                [
                    result["mode"],
                    f"{row['factor']:g}x",
                    f"{row['rate_rps']:.3f}",
                    str(row["num_requests"]),
                    str(row["num_refused"]),
                    str(row["num_ok"]),
                    str(row["num_unfinished"]),
                    f"{fmt_ms(ttft['p50'])}/{fmt_ms(ttft['p99'])}",
                    f"{fmt_ms(tpot['p50'])}/{fmt_ms(tpot['p99'])}",
                    "-" if row["goodput"] is None else f"{row['goodput']:.0%}",
                ]
            )
    return format_table(lines)


def plot(path: Path, results: list[dict[str, Any]], cal: Calibration) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        factors = [r["factor"] for r in result["levels"]]
        p99 = [(r["ttft_s"]["p99"] or float("nan")) * 1000 for r in result["levels"]]
        refused = [r["num_refused"] / max(r["num_requests"], 1) for r in result["levels"]]
        left.plot(factors, p99, marker="o", label=f"admission {result['mode']}")
        right.plot(factors, refused, marker="o", label=f"admission {result['mode']}")
    left.axhline(cal.ttft_target_s * 1000, color="grey", linestyle="--", label="TTFT target")
    left.set(
        xlabel="interactive load (x capacity)",
        ylabel="TTFT p99 of answered (ms)",
        xscale="log",
        yscale="log",
        title="TTFT p99",
    )
    right.set(
        xlabel="interactive load (x capacity)",
        ylabel="share refused",
        xscale="log",
        title="refused (429/529)",
    )
    for ax in (left, right):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = RunStart.now()
    workload = WorkloadConfig(  # bench/mixed_load.py's lengths
        max_model_len=args.max_model_len,
        prompt_len_median=args.prompt_len_median,
        output_len_median=args.output_len_median,
        length_tail=args.length_tail,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory(prefix="tokenfleet-overload-") as tmp_name:
        tmp = Path(tmp_name)
        cal = load_calibration(args, workload, tmp)
        log(
            f"capacity {cal.capacity_rps:.3f} req/s; targets TTFT {cal.ttft_target_s * 1000:.0f}"
            f" ms, TPOT {cal.tpot_target_s * 1000:.1f} ms"
        )
        results = [run_mode(mode, args, cal, workload, tmp) for mode in args.mode_list]
    for result in results:
        result["verdict"] = verdict(result, cal.ttft_target_s)
    print(table(results, cal))
    for result in results:
        log(f"admission {result['mode']}: {result['verdict']}")
    out = start.provenance(args) | {
        "args": args_json(args),
        "calibration": asdict(cal),
        "results": results,
    }
    write_result(args.out, RESULT_NAME, out, lambda path: plot(path, results, cal))
    ok = all(r["batch"]["every_request_one_result"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
