"""`tokenfleet bench`: the workload is exactly the seed's, long-tailed and within the
context; the statistics are exact on hand-made timings; a short run against a real
`tokenfleet serve --runner fixed` (one fixed token per step, no model) accounts for every
request, with exactly the requested output lengths, through each API and batch mode.

Stand-ins, named in each test's marker and name: the client tests answer from an
httpx.MockTransport peer (fake "transport"); the runs against a server use its fixed-token
runner (fake "runner")."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.live_server import MODEL, LiveServer, live_server

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.cli.main import main
from tokenfleet.loadgen import report
from tokenfleet.loadgen.batch_job import BatchJob, apply_result
from tokenfleet.loadgen.client import Endpoint, RequestRecord, stream_request
from tokenfleet.loadgen.workload import (
    MAX_LEN,
    MIN_LEN,
    TEMPLATE_MARGIN,
    WorkloadConfig,
    build_workload,
    fit_context,
    prompt_text,
    sample_length,
)

SMALL = WorkloadConfig(
    rate=2.0, duration_s=3.0, num_batch=2, prompt_len_median=100, output_len_median=20, seed=7
)

# -- workload -----------------------------------------------------------------------------


def test_the_workload_is_exactly_the_seeds() -> None:
    specs = build_workload(SMALL)
    assert [(s.req_id, s.kind, s.prompt_len, s.output_len) for s in specs] == [
        ("i-000000", "interactive", 179, 10),
        ("i-000001", "interactive", 74, 13),
        ("i-000002", "interactive", 119, 49),
        ("i-000003", "interactive", 109, 4),
        ("b-000000", "batch", 142, 77),
        ("b-000001", "batch", 139, 13),
    ]
    assert [s.arrival_s for s in specs] == pytest.approx(
        [1.026316947836881, 1.2358805572318092, 1.69038972611173, 2.3889210060230255, 0, 0],
        abs=1e-12,
    )
    assert build_workload(SMALL) == specs
    assert build_workload(WorkloadConfig(**{**SMALL.__dict__, "seed": 8})) != specs


def test_changing_the_batch_leaves_the_interactive_requests_as_they_were() -> None:
    more = build_workload(WorkloadConfig(**{**SMALL.__dict__, "num_batch": 50}))
    assert [s for s in more if s.kind == "interactive"] == build_workload(SMALL)[:4]
    assert sum(s.kind == "batch" for s in more) == 50


def test_lengths_are_long_tailed_and_clipped_to_bounds() -> None:
    rng = random.Random(1)
    lognormal = [sample_length(rng, 100, "lognormal", 3.0) for _ in range(2000)]
    assert min(lognormal) == MIN_LEN and max(lognormal) == MAX_LEN
    assert 60 <= sorted(lognormal)[1000] <= 140  # the median stays near the asked one
    pareto = [sample_length(rng, 100, "pareto", 0.5) for _ in range(2000)]
    assert min(pareto) == 25  # the scale: median / 2 ** (1 / alpha)
    assert max(pareto) == MAX_LEN
    assert sum(x > 10 * 100 for x in pareto) > 2000 * 0.05  # a heavy tail


def test_prompt_and_output_fit_the_context_less_the_template_margin() -> None:
    assert fit_context(100, 28, 192) == (100, 28)  # exactly the budget of 128
    assert fit_context(100, 29, 192) == (99, 29)  # shrunk in proportion
    assert fit_context(16000, 16000, 8192) == (4064, 4064)
    assert fit_context(16000, 4, 8192) == (8124, 4)  # neither below MIN_LEN
    assert fit_context(4, 16000, 8192) == (4, 8124)
    config = WorkloadConfig(
        rate=50, duration_s=4, num_batch=100, max_model_len=300, length_tail=2.0, seed=3
    )
    specs = build_workload(config)
    assert len(specs) > 200
    assert max(s.prompt_len + s.output_len for s in specs) == 300 - TEMPLATE_MARGIN
    assert min(min(s.prompt_len, s.output_len) for s in specs) == MIN_LEN


def test_prompts_are_as_many_tokens_as_asked_and_share_only_the_asked_prefix(
    model_folder: Path,
) -> None:
    tokenizer = Tokenizer(model_folder)
    specs = build_workload(SMALL)
    prompts = [prompt_text(SMALL, s) for s in specs]
    assert [len(tokenizer.encode(p)) for p in prompts] == [s.prompt_len for s in specs]
    assert len({tuple(p.split()[:4]) for p in prompts}) == len(prompts)
    shared = WorkloadConfig(**{**SMALL.__dict__, "shared_prefix_tokens": 70})
    words = [prompt_text(shared, s).split() for s in specs]  # the shortest has 74 words
    assert all(w[:70] == words[0][:70] for w in words)
    assert len({tuple(w[70:74]) for w in words}) == len(words)
    assert [len(w) for w in words] == [s.prompt_len for s in specs]


# -- statistics ---------------------------------------------------------------------------


def _record(
    req_id: str,
    sent: float,
    tokens: list[float],
    num_output: int,
    status: str = "ok",
    kind: str = "interactive",
) -> RequestRecord:
    record = RequestRecord(req_id, kind, 10, num_output, sent_s=sent, token_times_s=tokens)
    record.output_tokens = num_output
    record.finish(status, tokens[-1] if tokens else sent + 0.1)  # type: ignore[arg-type]
    return record


def test_percentiles_interpolate_between_closest_ranks() -> None:
    values = [0.4, 0.1, 0.3, 0.2]
    assert report.percentile(values, 50) == pytest.approx(0.25)
    assert report.percentile(values, 90) == pytest.approx(0.37)
    assert report.percentile(values, 99) == pytest.approx(0.397)
    assert report.percentile([5.0], 99) == 5.0
    assert report.percentile([], 50) is None


def test_summary_counts_classes_ttft_tpot_tokens_and_goodput_exactly() -> None:
    targets = report.Targets(ttft_s=0.5, tpot_s=0.1)
    records = [
        _record("a", 0.0, [0.5, 0.6, 0.7], 3),  # TTFT 0.5, TPOT 0.1: both at the target
        _record("b", 1.0, [1.2, 2.2], 2),  # TPOT 1.0: misses
        _record("c", 2.0, [3.0, 3.1, 3.2, 3.3, 3.4], 9),  # TTFT 1.0: misses; TPOT 0.05
        _record("d", 3.0, [3.1], 1),  # one token: no TPOT, meets both
        _record("e", 4.0, [], 0, "refused"),
        _record("f", 4.0, [], 0, "errored"),
        _record("g", 0.0, [1.0, 3.0], 5, kind="batch"),
    ]
    s = report.summarize(records, "interactive", targets)
    assert (s.num_requests, s.num_ok, s.num_refused, s.num_errored, s.num_unfinished) == (
        6,
        4,
        1,
        1,
        0,
    )
    assert s.ttft_s["p50"] == pytest.approx(0.35)  # of 0.5, 0.2, 1.0, 0.1
    assert s.tpot_s["p50"] == pytest.approx(0.1)  # of 0.1, 1.0, 0.05
    assert s.tpot_s["p99"] == pytest.approx(0.982)
    assert s.output_tokens == 15
    assert s.span_s == pytest.approx(4.1)  # sent at 0, the refusal at 4.0 done at 4.1
    assert s.output_tokens_per_s == pytest.approx(15 / 4.1)
    assert (s.num_good, s.goodput) == (2, pytest.approx(2 / 6))
    batch = report.summarize(records, "batch", targets)
    assert (batch.num_requests, batch.output_tokens, batch.span_s) == (1, 5, 3.0)
    assert batch.output_tokens_per_s == pytest.approx(5 / 3)
    assert batch.goodput is None


def test_timeline_bins_tokens_and_spreads_intervals() -> None:
    record = _record("a", 0.0, [0.2, 0.9, 1.0, 2.5], 8)  # two tokens per content event
    events = report.token_events(record)
    assert events == [(0.2, 0.2, 2.0), (0.9, 0.9, 2.0), (1.0, 1.0, 2.0), (2.5, 2.5, 2.0)]
    assert report.timeline(events, 3) == [4.0, 2.0, 2.0]
    assert report.timeline(events, 2) == [4.0, 4.0]  # past the end: the last bin
    assert report.timeline(events, 5, bin_s=0.5) == [4.0, 4.0, 4.0, 0.0, 0.0 + 4.0]
    assert report.timeline([(0.5, 2.5, 10.0)], 3) == [2.5, 5.0, 2.5]
    assert report.timeline([(0.5, 4.0, 7.0)], 2) == [1.0, 6.0]


def test_batch_results_of_either_api_fill_the_records() -> None:
    records = {i: RequestRecord(i, "batch", 10, 5) for i in ("a", "b", "c", "d")}
    usage_a = {"input_tokens": 12, "output_tokens": 5}
    usage_c = {"prompt_tokens": 13, "completion_tokens": 4}
    lines: list[dict[str, Any]] = [
        {"custom_id": "a", "result": {"type": "succeeded", "message": {"usage": usage_a}}},
        {"custom_id": "b", "result": {"type": "expired"}},
        {"custom_id": "c", "response": {"status_code": 200, "body": {"usage": usage_c}}},
        {"custom_id": "d", "response": None, "error": {"code": "x", "message": "failed thrice"}},
        {"custom_id": "zz", "result": {"type": "succeeded"}},  # not ours: ignored
    ]
    for line in lines:
        apply_result(line, records, 7.0)
    got = [(r.status, r.prompt_tokens, r.output_tokens, r.error) for r in records.values()]
    assert got == [
        ("ok", 12, 5, None),
        ("errored", None, None, "expired"),
        ("ok", 13, 4, None),
        ("errored", None, None, "failed thrice"),
    ]
    assert all(r.done_s == 7.0 for r in records.values())


def test_batch_tokens_are_spread_over_the_polls_that_saw_requests_finish() -> None:
    job = BatchJob(submitted_s=0.5, samples=[(1.0, 0), (2.0, 3), (3.0, 3), (4.0, 5)])
    assert job.token_intervals(10.0) == [(1.0, 2.0, 30.0), (3.0, 4.0, 20.0)]


# -- one request, against a peer's answers --------------------------------------------------


def _one(handler: Any, api: str = "openai") -> RequestRecord:
    spec = build_workload(SMALL)[0]
    record = RequestRecord.of(spec)
    endpoint = Endpoint("http://peer", api, MODEL)
    ticks = iter(range(100))

    async def send() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            clock = lambda: float(next(ticks))  # noqa: E731
            await stream_request(http, endpoint, spec, "hi", record, clock, timeout_s=5)

    asyncio.run(send())
    return record


def _sse(*events: Any) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


@pytest.mark.fake("transport")
def test_refusals_are_counted_not_retried_on_a_mock_transport() -> None:
    calls = []

    def overloaded(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        return httpx.Response(529, json={"error": {"type": "overloaded", "message": "busy"}})

    record = _one(overloaded, "anthropic")
    assert (record.status, record.http_status, record.error, len(calls)) == (
        "refused",
        529,
        "busy",
        1,
    )
    assert calls[0]["ignore_eos"] is True and calls[0]["max_tokens"] == 10


@pytest.mark.fake("transport")
def test_a_stream_without_usage_counts_its_content_events_on_a_mock_transport() -> None:
    def peer(request: httpx.Request) -> httpx.Response:
        chunks = [{"choices": [{"delta": {"content": c}}]} for c in ("a", "", "b", "c")]
        return httpx.Response(200, content=_sse(*chunks))

    record = _one(peer)
    assert (record.status, record.output_tokens, record.usage_reported) == ("ok", 3, False)
    assert record.token_times_s == [1.0, 3.0, 4.0]  # the clock ticked once per event
    assert record.ttft_s == 1.0 and record.tpot_s == 1.5


@pytest.mark.fake("transport")
def test_a_chunk_with_logprobs_and_no_text_is_a_token_arrival_on_a_mock_transport() -> None:
    """A special token (skipped in the text) shows only in the chunk's logprobs."""

    def server(request: httpx.Request) -> httpx.Response:
        def chunk(text: str, token: str | None) -> dict[str, Any]:
            logprobs = {"content": [{"token": token, "logprob": -0.1}]} if token else None
            return {"choices": [{"delta": {"content": text}, "logprobs": logprobs}]}

        chunks = [chunk("a", "a"), chunk("", "<|im_end|>"), chunk("", None), chunk("b", "b")]
        return httpx.Response(200, content=_sse(*chunks))

    record = _one(server)
    assert record.token_times_s == [1.0, 2.0, 4.0]


@pytest.mark.fake("transport")
def test_an_error_event_in_a_200_stream_is_an_error_on_a_mock_transport() -> None:
    def peer(request: httpx.Request) -> httpx.Response:
        content = _sse({"choices": [{"delta": {"content": "a"}}]}, {"error": {"message": "oom"}})
        return httpx.Response(200, content=content)

    record = _one(peer)
    assert (record.status, record.error) == ("errored", "_StreamError: oom")


# -- against a real server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("loadgen")
    with live_server(tmp, "--runner", "fixed", "--ttft-target", "60") as s:
        yield s


RUN = ["--rate", "4", "--duration", "5", "--num-batch", "20", "--seed", "11"]
LENGTHS = ["--prompt-len-median", "32", "--output-len-median", "16", "--max-model-len", "512"]


# Goodput counts the requests that meet the bench's TTFT and TPOT targets: with targets no
# run can miss, every ok request counts whatever the machine's speed. (The arithmetic is
# tested exactly on hand-made timings above; here it is the accounting.)
NO_MISS_TARGETS = ["--ttft-target", "3600", "--tpot-target", "3600"]


def _bench(server: LiveServer, out: Path, *args: str) -> dict[str, Any]:
    argv = ["bench", "--url", server.url, "--out", str(out), "--quiet", *args]
    assert main(argv) == 0
    return dict(json.loads((out / "bench.json").read_text()))


@pytest.mark.fake("runner")
@pytest.mark.parametrize(
    ("api", "mode"),
    [
        ("openai", "api"),
        ("anthropic", "api"),
        ("openai", "concurrent"),
        ("anthropic", "concurrent"),
    ],
)
def test_fixed_runner_short_run_accounts_for_every_request_with_exact_output_lengths(
    server: LiveServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    api: str,
    mode: str,
) -> None:
    args = [*RUN, *LENGTHS, *NO_MISS_TARGETS, "--api", api, "--batch-mode", mode]
    data = _bench(server, tmp_path, *args)
    workload = WorkloadConfig(
        rate=4, duration_s=5, num_batch=20, seed=11, max_model_len=512,
        prompt_len_median=32, output_len_median=16,
    )  # fmt: skip
    specs = {s.req_id: s for s in build_workload(workload)}
    assert data["endpoint"] == {"url": server.url, "api": api, "model": MODEL, "batch_mode": mode}
    assert data["seed"] == 11 and data["args"]["workload"]["rate"] == 4
    requests = data["requests"]
    assert [r["req_id"] for r in requests] == list(specs)
    for kind in ("interactive", "batch"):
        s = data["summary"][kind]
        mine = [r for r in requests if r["kind"] == kind]
        assert s["num_requests"] == len(mine) == sum(x.kind == kind for x in specs.values())
        assert s["num_ok"] + s["num_refused"] + s["num_errored"] == s["num_requests"]
        assert (s["num_ok"], s["num_unfinished"]) == (s["num_requests"], 0)  # a fixed server
        assert all(r["sent_s"] is not None and r["usage_reported"] for r in mine)
        assert [r["output_tokens"] for r in mine] == [specs[r["req_id"]].output_len for r in mine]
        assert s["output_tokens"] == sum(specs[r["req_id"]].output_len for r in mine)
        timeline = data["timeline"]["output_tokens_per_s"][kind]
        assert sum(timeline) * data["timeline"]["bin_s"] == pytest.approx(s["output_tokens"])
        assert s["output_tokens_per_s"] > 0
    interactive = data["summary"]["interactive"]
    assert interactive["ttft_s"]["p50"] > 0 and interactive["num_good"] == len(
        [r for r in requests if r["kind"] == "interactive"]
    )
    if mode == "api":
        assert data["batch_job"]["state"] in ("completed", "ended")
        assert len((tmp_path / "batch_results.jsonl").read_text().splitlines()) == 20
        assert data["summary"]["batch"]["ttft_s"]["p50"] is None  # the Batch API has no TTFT
    else:
        assert data["batch_job"] is None and data["summary"]["batch"]["ttft_s"]["p50"] > 0
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "goodput: " in table and f"batch mode {mode}" in table


@pytest.mark.fake("runner")
def test_fixed_runner_drain_limit_ends_the_run_and_cancels_the_batch(
    server: LiveServer, tmp_path: Path
) -> None:
    """The limit is a time (duration + drain), so the run is made to outlast it many times
    over: ~8,000 tokens each, one engine step per token, and no drain, so the limit falls at
    0.5 s, 0.26 s after the second interactive request is sent (at 0.24 s, the seed's
    arrivals): to finish it the whole system would need 8,000 steps and streamed tokens in
    those 0.26 s, a step every 33 us."""
    args = ["--rate", "8", "--duration", "0.5", "--drain", "0", "--num-batch", "20"]
    args += ["--batch-mode", "api", "--prompt-len-median", "32", "--output-len-median", "8000"]
    data = _bench(server, tmp_path, *args, "--length-tail", "0.05")
    requests = data["requests"]
    assert [r["kind"] for r in requests] == ["interactive"] * 2 + ["batch"] * 20
    assert {r["status"] for r in requests} == {"unfinished"}
    assert all(r["sent_s"] is not None for r in requests)
    assert data["summary"]["batch"]["num_unfinished"] == 20
    batch_id = data["batch_job"]["batch_id"]
    state = httpx.get(f"{server.url}/v1/batches/{batch_id}", timeout=60).json()["status"]
    assert state in ("cancelling", "cancelled")
