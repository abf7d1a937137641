"""One bench run, start to end:

    t=0 ─┬─ batch: N requests at once (Batch API, or streamed, <= batch_concurrency in flight)
         └─ interactive: Poisson arrivals until duration_s, each streamed at its time
    duration_s ── wait for what is in flight ── duration_s + drain_s: cancel what is left

Then the statistics, the table, bench.json and bench.png in the out folder. The run never
outlasts duration_s + drain_s (plus the last polls and the results download).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from tokenfleet.loadgen import report
from tokenfleet.loadgen.batch_job import (
    BATCH_INPUT,
    BatchJob,
    has_batch_api,
    run_batch_job,
    write_batch_input,
)
from tokenfleet.loadgen.client import Endpoint, RequestRecord, stream_request
from tokenfleet.loadgen.workload import RequestSpec, WorkloadConfig, build_workload, prompt_text

logger = logging.getLogger(__name__)

BATCH_MODES = ("auto", "api", "concurrent", "none")
BIN_S = 1.0
SCHEMA = "tokenfleet.bench/1"


@dataclass(frozen=True)
class BenchConfig:
    url: str
    out: Path
    api: str = "openai"
    model: str | None = None  # None: the first of the endpoint's /v1/models
    api_key: str | None = None
    batch_mode: str = "auto"  # auto: api where the endpoint lists batches, else concurrent
    batch_concurrency: int = 64
    batch_priority: int | None = 1  # the body's `priority` of streamed batch requests
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.06
    ignore_eos: bool = True
    timeout_s: float = 600.0  # per streamed request
    drain_s: float = 300.0  # after duration_s, for what is still in flight
    progress: bool = True
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __post_init__(self) -> None:
        if self.batch_mode not in BATCH_MODES:
            raise ValueError(f"batch_mode must be one of {BATCH_MODES}, got {self.batch_mode!r}")
        if self.batch_concurrency < 1:
            raise ValueError("batch_concurrency must be at least 1")
        for name in ("ttft_target_s", "tpot_target_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0")
        if self.drain_s < 0:
            raise ValueError("drain_s must be >= 0")


@dataclass
class BenchResult:
    config: BenchConfig
    endpoint: Endpoint
    batch_mode: str  # as run: api, concurrent or none
    started_at: float  # wall clock (time.time()) at t=0
    elapsed_s: float
    records: list[RequestRecord]
    batch_job: BatchJob | None
    summaries: list[report.ClassSummary]
    timelines: dict[str, list[float]]


async def _model_of(http: httpx.AsyncClient, url: str) -> str:
    response = await http.get(f"{url}/v1/models", timeout=10)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def run_bench(config: BenchConfig) -> BenchResult:
    """Run the workload against the endpoint; every request ends in its record."""
    workload = config.workload
    specs = build_workload(workload)
    url = config.url.rstrip("/")
    headers = Endpoint(url, config.api, "", config.api_key).headers()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as http:
        model = config.model or await _model_of(http, url)
        endpoint = Endpoint(url, config.api, model, config.api_key, config.ignore_eos)
        batch = [s for s in specs if s.kind == "batch"]
        mode = config.batch_mode if batch else "none"
        if mode == "auto":
            mode = "api" if await has_batch_api(http, endpoint) else "concurrent"
        if mode == "none":
            specs = [s for s in specs if s.kind == "interactive"]
            batch = []
        records = {s.req_id: RequestRecord.of(s) for s in specs}
        job = BatchJob() if mode == "api" else None
        if job is not None:  # before t=0: it takes seconds for a large batch
            config.out.mkdir(parents=True, exist_ok=True)
            pairs = ((s, prompt_text(workload, s)) for s in batch)
            write_batch_input(endpoint, pairs, config.out / BATCH_INPUT)
        bar = tqdm(total=len(specs), unit="req", file=sys.stderr, disable=not config.progress)
        started_at, t0 = time.time(), time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        semaphore = asyncio.Semaphore(config.batch_concurrency)

        async def send(spec: RequestSpec) -> None:
            record = records[spec.req_id]
            is_batch = spec.kind == "batch"
            try:
                async with semaphore if is_batch else contextlib.nullcontext():
                    await stream_request(
                        http,
                        endpoint,
                        spec,
                        prompt_text(workload, spec),
                        record,
                        clock,
                        timeout_s=config.timeout_s,
                        priority=config.batch_priority if is_batch else None,
                    )
            finally:  # a batch request cut off while it waited for its turn
                if record.status == "pending":
                    record.finish("unfinished", clock(), "the run's drain limit passed")
                bar.update(1)

        tasks: list[asyncio.Task[Any]] = []
        if job is not None:
            mine = [records[s.req_id] for s in batch]
            work = run_batch_job(job, endpoint, mine, config.out, clock, bar.update)
            tasks.append(asyncio.create_task(work))
        elif mode == "concurrent":
            tasks += [asyncio.create_task(send(s)) for s in batch]
        with bar:
            for spec in specs:
                if spec.kind != "interactive":
                    continue
                await asyncio.sleep(max(spec.arrival_s - clock(), 0.0))
                tasks.append(asyncio.create_task(send(spec)))
            await _drain(tasks, workload.duration_s + config.drain_s - clock())
        elapsed = clock()
    ordered = [records[s.req_id] for s in specs]
    return BenchResult(
        config=config,
        endpoint=endpoint,
        batch_mode=mode,
        started_at=started_at,
        elapsed_s=elapsed,
        records=ordered,
        batch_job=job,
        summaries=[report.summarize(ordered, kind, _targets(config)) for kind in report.KINDS],
        timelines=_timelines(ordered, job, elapsed),
    )


async def _drain(tasks: list[asyncio.Task[Any]], limit_s: float) -> None:
    """Wait up to limit_s for the tasks; cancel the rest and wait for them to record it."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(limit_s, 0.0))
    for task in pending:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, Exception):  # a bug, not a request's failure: those are recorded
            raise result


def _targets(config: BenchConfig) -> report.Targets:
    return report.Targets(config.ttft_target_s, config.tpot_target_s)


def _timelines(
    records: list[RequestRecord], job: BatchJob | None, elapsed_s: float
) -> dict[str, list[float]]:
    num_bins = max(math.ceil(elapsed_s / BIN_S), 1)
    events: dict[str, list[report.TokenEvent]] = {kind: [] for kind in report.KINDS}
    for record in records:
        events[record.kind] += report.token_events(record)
    if job is not None:  # the Batch API tells request counts only, while it runs
        batch = [r for r in records if r.kind == "batch"]
        num_done = job.samples[-1][1] if job.samples else 0
        total = sum(r.output_tokens or 0 for r in batch if r.status == "ok")
        events["batch"] += job.token_intervals(total / num_done if num_done else 0.0)
    return {kind: report.timeline(events[kind], num_bins, BIN_S) for kind in report.KINDS}


def to_json(result: BenchResult) -> dict[str, Any]:
    """bench.json: the args and seed, the endpoint, the summary, the timeline and every
    request's timings."""
    job = result.batch_job
    return {
        "schema": SCHEMA,
        "args": _jsonable(dataclasses.asdict(result.config)),
        "seed": result.config.workload.seed,
        "endpoint": {
            "url": result.endpoint.url,
            "api": result.endpoint.api,
            "model": result.endpoint.model,
            "batch_mode": result.batch_mode,
        },
        "started_at": result.started_at,
        "elapsed_s": result.elapsed_s,
        "summary": {s.kind: report.summary_dict(s) for s in result.summaries},
        "batch_job": None if job is None else dataclasses.asdict(job),
        "timeline": {"bin_s": BIN_S, "output_tokens_per_s": result.timelines},
        "requests": [_record_json(r) for r in result.records],
    }


def _record_json(record: RequestRecord) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    data["token_times_s"] = [round(t, 6) for t in record.token_times_s]
    data["ttft_s"], data["tpot_s"] = record.ttft_s, record.tpot_s
    return data


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return str(value) if isinstance(value, Path) else value


def bench(config: BenchConfig) -> tuple[BenchResult, str]:
    """Run, write bench.json and bench.png into config.out; the result and its table."""
    result = asyncio.run(run_bench(config))
    config.out.mkdir(parents=True, exist_ok=True)
    report.write_json(config.out / "bench.json", to_json(result))
    report.plot(config.out / "bench.png", result.records, result.timelines, BIN_S)
    return result, report.format_table(result.summaries, _targets(config))
