"""The batch class through the endpoint's own Batch API (`--batch-mode api`), over
tokenfleet.client.batch on worker threads:

    batch_input.jsonl ─► submit (OpenAI: /v1/files, then /v1/batches; Anthropic:
    /v1/messages/batches) ─► poll once a second (requests done) ─► ended ─►
    batch_results.jsonl ─► each request's status and output tokens, from its usage

While the batch runs only its request counts are known, so the timeline spreads (requests
done since the last poll) x (output tokens per request, from the results) over each poll
interval; the results give the exact total. A batch still running when the run's drain
limit passes is cancelled, so that it does not load the next measurement.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from tokenfleet.client.batch import BatchClient, BatchError
from tokenfleet.loadgen.client import REFUSAL_STATUSES, Endpoint, RequestRecord
from tokenfleet.loadgen.workload import RequestSpec

logger = logging.getLogger(__name__)

POLL_S = 1.0
BATCH_INPUT = "batch_input.jsonl"
BATCH_RESULTS = "batch_results.jsonl"


@dataclass
class BatchJob:
    """One submitted batch, as the client saw it; times since the run's start."""

    batch_id: str | None = None
    state: str | None = None
    submitted_s: float | None = None
    ended_s: float | None = None  # the first poll that saw the batch ended
    # The first poll that saw its final count of requests done: the end of its work (an
    # OpenAI batch ends a moment later, once its result files are written).
    done_s: float | None = None
    samples: list[tuple[float, int]] = field(default_factory=list)  # (time, requests done)

    def token_intervals(self, tokens_per_request: float) -> list[tuple[float, float, float]]:
        """(start, end, output tokens) per poll interval in which requests finished."""
        intervals = []
        last_t, last_done = self.submitted_s or 0.0, 0
        for t, done in self.samples:
            if done > last_done:
                intervals.append((last_t, t, (done - last_done) * tokens_per_request))
            last_t, last_done = t, done
        return intervals


def batch_api_path(endpoint: Endpoint) -> str:
    return "/v1/batches" if endpoint.api == "openai" else "/v1/messages/batches"


async def has_batch_api(http: httpx.AsyncClient, endpoint: Endpoint) -> bool:
    """Whether the endpoint lists batches (peers without a Batch API answer 404)."""
    try:
        response = await http.get(
            endpoint.url + batch_api_path(endpoint), params={"limit": 1}, timeout=10
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def batch_line(endpoint: Endpoint, spec: RequestSpec, prompt: str) -> dict[str, Any]:
    body = endpoint.body(spec, prompt, stream=False)
    if endpoint.api == "anthropic":
        return {"custom_id": spec.req_id, "params": body}
    return {"custom_id": spec.req_id, "method": "POST", "url": endpoint.path, "body": body}


def apply_result(line: dict[str, Any], records: dict[str, RequestRecord], now: float) -> None:
    """One results line (Anthropic's or OpenAI's) into its request's record."""
    record = records.get(str(line.get("custom_id")))
    if record is None:
        return
    if "result" in line:  # Anthropic: {"custom_id", "result": {"type", "message" | "error"}}
        result = line["result"] or {}
        usage = (result.get("message") or {}).get("usage")
        if result.get("type") == "succeeded" and usage:
            # The whole prompt: Anthropic counts its cached part apart.
            cached = usage.get("cache_read_input_tokens", 0) + usage.get(
                "cache_creation_input_tokens", 0
            )
            record.prompt_tokens = usage["input_tokens"] + cached
            record.output_tokens = usage["output_tokens"]
            record.usage_reported = True
            record.finish("ok", now)
        else:
            error = (result.get("error") or {}).get("error") or {}
            record.finish("errored", now, str(error.get("message") or result.get("type")))
        return
    response = line.get("response") or {}  # OpenAI: {"custom_id", "response", "error"}
    body = response.get("body") or {}
    if response.get("status_code") == 200 and body.get("usage"):
        record.prompt_tokens = body["usage"]["prompt_tokens"]
        record.output_tokens = body["usage"]["completion_tokens"]
        record.usage_reported = True
        record.finish("ok", now)
    else:
        error = line.get("error") or body.get("error") or {}
        record.finish("errored", now, str(error.get("message") or error or "no response"))


def write_batch_input(
    endpoint: Endpoint, pairs: Iterable[tuple[RequestSpec, str]], path: Path
) -> None:
    """The batch's requests, one (spec, prompt) a line, in either API's batch format."""
    with path.open("w", encoding="utf-8") as sink:
        for spec, prompt in pairs:
            sink.write(json.dumps(batch_line(endpoint, spec, prompt)) + "\n")


async def run_batch_job(
    job: BatchJob,
    endpoint: Endpoint,
    mine: list[RequestRecord],
    out_dir: Path,
    clock: Callable[[], float],
    on_done: Callable[[int], None],
) -> None:
    """Submit out_dir/BATCH_INPUT (see write_batch_input) as one batch, follow it to its
    end, fill in `job` and the records of its requests (`mine`); `on_done(n)` as n more
    of them finish."""
    path = out_dir / BATCH_INPUT

    def fail_all(status: Literal["refused", "errored"], message: str) -> None:
        for record in mine:
            if record.status == "pending":
                record.finish(status, clock(), message)

    with BatchClient(endpoint.url, endpoint.api_key) as client:
        try:
            job.submitted_s = clock()
            for record in mine:
                record.sent_s = job.submitted_s
            try:
                job.batch_id = await asyncio.to_thread(client.submit, path)
            except BatchError as exc:
                fail_all("refused" if exc.status in REFUSAL_STATUSES else "errored", str(exc))
                on_done(len(mine))
                return
            await _follow(client, job, clock, on_done)
            assert job.batch_id is not None and job.ended_s is not None
            results = out_dir / BATCH_RESULTS
            try:
                await asyncio.to_thread(client.write_results, job.batch_id, results)
            except BatchError as exc:
                fail_all("errored", f"no results: {exc}")
                return
            final = job.samples[-1][1]
            job.done_s = next(t for t, done in job.samples if done == final)
            by_id = {r.req_id: r for r in mine}
            with results.open(encoding="utf-8") as source:
                for line in source:
                    apply_result(json.loads(line), by_id, job.done_s)
            fail_all("errored", "no line for it in the batch's results")
        except asyncio.CancelledError:
            if job.batch_id is not None and job.ended_s is None:
                await asyncio.to_thread(_cancel, endpoint, job.batch_id)
            for record in mine:
                if record.status == "pending":
                    record.finish("unfinished", clock(), "the run's drain limit passed")
            raise


async def _follow(
    client: BatchClient, job: BatchJob, clock: Callable[[], float], on_done: Callable[[int], None]
) -> None:
    assert job.batch_id is not None
    num_done = 0
    while True:
        try:
            status = await asyncio.to_thread(client.status, job.batch_id)
        except BatchError as exc:  # a poll lost is no reason to give the batch up
            logger.warning("batch %s: %s", job.batch_id, exc)
            await asyncio.sleep(POLL_S)
            continue
        now = clock()
        job.state = status.state
        job.samples.append((now, status.num_done))
        on_done(status.num_done - num_done)
        num_done = status.num_done
        if status.ended:
            job.ended_s = now
            return
        await asyncio.sleep(POLL_S)


def _cancel(endpoint: Endpoint, batch_id: str) -> None:
    url = f"{endpoint.url}{batch_api_path(endpoint)}/{batch_id}/cancel"
    try:
        httpx.post(url, headers=endpoint.headers(), timeout=10).raise_for_status()
        logger.info("cancelled batch %s at the drain limit", batch_id)
    except httpx.HTTPError as exc:
        logger.warning("could not cancel batch %s: %s", batch_id, exc)
