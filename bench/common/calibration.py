"""The mixed-load calibration, on a running server: the single-stream decode step, the
prefill rate, and a closed-loop probe for the capacity; the TPOT and TTFT targets and the
interactive rate from them (bench/mixed_load.py's docstring has the recipe)."""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx

from common.log import log
from tokenfleet.loadgen.client import Endpoint, RequestRecord, stream_request
from tokenfleet.loadgen.report import percentile
from tokenfleet.loadgen.workload import RequestSpec, WorkloadConfig, build_workload, prompt_text


@dataclass(frozen=True)
class GreedyEndpoint(Endpoint):
    """Calibration streams: greedy, so that nothing but the step is measured."""

    def body(self, spec: RequestSpec, prompt: str, *, stream: bool) -> dict[str, Any]:
        return super().body(spec, prompt, stream=stream) | {"temperature": 0}


@dataclass(frozen=True)
class Calibration:
    decode_step_s: float  # median TPOT of a single greedy stream
    prefill_tokens_per_s: float  # prefill_probe_len / median TTFT of it alone
    prefill_probe_len: int
    p90_prompt_len: int
    mean_prompt_len: int
    mean_output_len: int
    tpot_target_s: float
    ttft_target_s: float
    probe: list[dict[str, float]]  # per concurrency: req/s, TPOT p90, TTFT p90
    capacity_rps: float
    rate_rps: float  # --load x capacity


async def _streams(
    url: str,
    specs: list[RequestSpec],
    workload: WorkloadConfig,
    concurrency: int,
    until_s: float | None = None,
) -> list[RequestRecord]:
    """specs streamed `concurrency` at a time (closed loop); none started after until_s."""
    async with httpx.AsyncClient(timeout=600) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        endpoint = GreedyEndpoint(url, "openai", model)
        t0 = time.perf_counter()
        queue = list(reversed(specs))
        records: list[RequestRecord] = []

        def clock() -> float:
            return time.perf_counter() - t0

        async def worker() -> None:
            while queue and (until_s is None or clock() < until_s):
                spec = queue.pop()
                record = RequestRecord.of(spec)
                await stream_request(
                    http, endpoint, spec, prompt_text(workload, spec), record, clock, timeout_s=600
                )
                records.append(record)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records


def _spec(name: str, prompt_len: int, output_len: int) -> RequestSpec:
    return RequestSpec(f"cal-{name}", "interactive", 0.0, prompt_len, output_len)


def _median(values: list[float | None]) -> float:
    present = [v for v in values if v is not None]
    if not present:
        raise RuntimeError("calibration: no request finished")
    return statistics.median(present)


def calibrate(url: str, args: argparse.Namespace, workload: WorkloadConfig) -> Calibration:
    lengths = [
        (s.prompt_len, s.output_len)
        for s in build_workload(replace(workload, rate=5.0, duration_s=200.0))
    ]  # a large sample of the workload's interactive lengths
    mean_prompt = round(statistics.fmean(p for p, _ in lengths))
    mean_output = round(statistics.fmean(o for _, o in lengths))
    p90_prompt = round(percentile([p for p, _ in lengths], 90) or mean_prompt)
    repeats = 2 if args.quick else 5
    asyncio.run(
        _streams(url, [_spec(f"warm-{i}", 64, 8) for i in range(2)], workload, 1)
    )  # warm-up
    decode = asyncio.run(
        _streams(url, [_spec(f"decode-{i}", 16, 64) for i in range(repeats)], workload, 1)
    )
    step = _median([r.tpot_s for r in decode])
    prefill = asyncio.run(
        _streams(
            url,
            [_spec(f"prefill-{i}", args.prefill_probe_len, 1) for i in range(repeats)],
            workload,
            1,
        )
    )
    rate = args.prefill_probe_len / _median([r.ttft_s for r in prefill])
    tpot_target = 2 * step
    ttft_target = 2 * p90_prompt / rate
    log(
        f"decode step {step * 1000:.1f} ms, prefill {rate:.0f} tokens/s; targets: TPOT "
        f"{tpot_target * 1000:.1f} ms, TTFT {ttft_target * 1000:.0f} ms (p90 prompt {p90_prompt})"
    )
    probe, capacity = [], 0.0
    for level in args.probe_levels:
        specs = [_spec(f"probe{level}-{i}", mean_prompt, mean_output) for i in range(10_000)]
        records = asyncio.run(_streams(url, specs, workload, level, until_s=args.probe_s))
        ok = [r for r in records if r.status == "ok"]
        span = max(r.done_s or 0.0 for r in ok) if ok else math.inf
        row = {
            "concurrency": level,
            "requests_per_s": len(ok) / span,
            "tpot_p90_s": percentile([t for r in ok if (t := r.tpot_s) is not None], 90) or 0.0,
            "ttft_p90_s": percentile([t for r in ok if (t := r.ttft_s) is not None], 90) or 0.0,
        }
        probe.append(row)
        within = row["tpot_p90_s"] <= tpot_target and row["ttft_p90_s"] <= ttft_target
        log(
            f"probe {level} streams: {row['requests_per_s']:.2f} req/s, TPOT p90 "
            f"{row['tpot_p90_s'] * 1000:.1f} ms, TTFT p90 {row['ttft_p90_s'] * 1000:.0f} ms"
            f"{'' if within else ' (over a target)'}"
        )
        if not within:
            break
        capacity = max(capacity, row["requests_per_s"])
    if capacity == 0.0:  # even one stream breaks a target: one stream's rate is the capacity
        capacity = probe[0]["requests_per_s"]
    return Calibration(
        step,
        rate,
        args.prefill_probe_len,
        p90_prompt,
        mean_prompt,
        mean_output,
        tpot_target,
        ttft_target,
        probe,
        capacity,
        args.load * capacity,
    )
