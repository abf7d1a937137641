"""Fault paths of `tokenfleet serve` with real processes and real signals: an engine that
hangs (SIGSTOP) is found by the heartbeat timeout and replaced; an engine outlives no
gateway killed alone; a cancel through one gateway stops the requests another runs; a
SIGTERM mid-batch commits what is done and gives every lease back; a request whose engine
dies on every attempt ends errored while the rest of its batch succeeds. Events are
awaited by polling the state (HTTP, /metrics, the batch store) with generous timeouts."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, create_engine, text
from support.live_server import (
    HTTP_TIMEOUT_S,
    MODEL,
    LiveServer,
    live_server,
    process_is_gone,
    wait_until,
)

from tokenfleet.batch.store import engine_url

pytestmark = pytest.mark.slow


# -- helpers ---------------------------------------------------------------------------------


def gateway(
    tmp: Path, *args: str, data_dir: Path | None = None
) -> AbstractContextManager[LiveServer]:
    """`tokenfleet serve` with `args`, on `data_dir`'s store if given; in a process group of
    its own, so that a test can signal the gateway alone and the cleanup still reaches
    whatever the gateway left."""
    store = () if data_dir is None else ("--data-dir", str(data_dir))
    return live_server(tmp, *args, *store)


def health(server: LiveServer) -> int:
    try:
        return httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT_S).status_code
    except httpx.HTTPError:
        return 0


def labelled_metric(server: LiveServer, line_start: str) -> float:
    """The value of the /metrics line that starts with `line_start` (0 if none)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=HTTP_TIMEOUT_S).text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


def batch_running_in_engine(server: LiveServer) -> float:
    return labelled_metric(server, 'tokenfleet_num_requests_running_by_class{class="batch"}')


def committed(server: LiveServer, outcome: str) -> float:
    return labelled_metric(server, f'tokenfleet_batch_results_total{{outcome="{outcome}"}}')


@contextmanager
def store_reader(url: str) -> Iterator[Engine]:
    engine = create_engine(engine_url(url))
    try:
        yield engine
    finally:
        engine.dispose()


def request_rows(store: Engine, batch_id: str) -> list[Any]:
    """The batch's request rows as the store has them now, in input order."""
    with store.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT idx, custom_id, status, attempts, lease_owner, result"
                    " FROM batch_requests WHERE batch_id = :b ORDER BY idx"
                ),
                {"b": batch_id},
            ).all()
        )


def sqlite_url(data_dir: Path) -> str:
    return f"sqlite:///{data_dir / 'batches.db'}"


def chat_line(custom_id: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Say something about {custom_id}."}],
    }
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": body | fields,
    }


def create_openai_batch(server: LiveServer, lines: list[dict[str, Any]]) -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = httpx.post(
        f"{server.url}/v1/files",
        files={"file": ("input.jsonl", content)},
        data={"purpose": "batch"},
        timeout=60,
    )
    assert upload.status_code == 200, upload.text
    created = httpx.post(
        f"{server.url}/v1/batches",
        json={
            "input_file_id": upload.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        timeout=60,
    )
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def openai_batch(server: LiveServer, batch_id: str) -> dict[str, Any]:
    return dict(httpx.get(f"{server.url}/v1/batches/{batch_id}", timeout=HTTP_TIMEOUT_S).json())


def message_batch(server: LiveServer, batch_id: str) -> dict[str, Any]:
    url = f"{server.url}/v1/messages/batches/{batch_id}"
    return dict(httpx.get(url, timeout=HTTP_TIMEOUT_S).json())


def file_lines(server: LiveServer, file_id: str) -> list[dict[str, Any]]:
    content = httpx.get(f"{server.url}/v1/files/{file_id}/content", timeout=HTTP_TIMEOUT_S)
    assert content.status_code == 200, content.text
    return [json.loads(line) for line in content.text.splitlines()]


def message(server: LiveServer, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Name a colour."}],
        },
        timeout=180,
    )


# -- 1. an engine that hangs ----------------------------------------------------------------


def test_a_hung_engine_is_killed_after_the_heartbeat_timeout_and_served_again(
    tmp_path: Path,
) -> None:
    """SIGSTOP the engine: the request it holds fails with a 503 (not a hang), /health says
    503 once the heartbeat (`heartbeat_timeout_s`, 30 s by default: `serve` has no flag
    for it) is late, the gateway kills the stopped process and starts a new engine, and
    /health and a request succeed again."""
    with gateway(tmp_path) as server:
        old_pid = server.engine_pid()
        try:
            os.kill(old_pid, signal.SIGSTOP)
            with ThreadPoolExecutor(1) as pool:
                held = pool.submit(message, server)  # admitted: the engine looks alive yet
                wait_until(lambda: health(server) == 503, 120, "/health 503", every=0.2)
                server.wait_healthy(timeout=150)
                lost = held.result(timeout=60)
            assert lost.status_code == 503, lost.text
            error = lost.json()
            assert error["type"] == "error" and error["error"]["type"] == "api_error", error
            assert server.engine_pid() != old_pid
            assert process_is_gone(old_pid)  # killed, not left stopped
            reply = message(server)
            assert reply.status_code == 200, reply.text
            assert reply.json()["content"][0]["text"]
        finally:
            if not process_is_gone(old_pid):
                os.kill(old_pid, signal.SIGKILL)


# -- 2. the gateway dying alone -------------------------------------------------------------


def test_the_engine_exits_when_its_gateway_alone_is_sigkilled(tmp_path: Path) -> None:
    with gateway(tmp_path) as server:
        engine_pid = server.engine_pid()
        os.kill(server.process.pid, signal.SIGKILL)  # the gateway only, not its group
        server.process.wait(timeout=30)
        wait_until(lambda: process_is_gone(engine_pid), 60, f"engine {engine_pid} gone")


# -- 3. a cancel through another gateway ----------------------------------------------------


def test_a_cancel_through_one_gateway_stops_the_requests_running_on_another(
    tmp_path: Path, postgres_url: str
) -> None:
    """Gateways A and B share one PostgreSQL store. A batch created on B runs on B (its
    requests are long: 400 tokens, ignore_eos); canceled through A, B finds the cancel in
    the store, aborts them in its engine and commits them canceled itself, well within
    the lease time (so no lease expiry did it); the batch ends cancelled, counts adding up."""
    num_requests = 4
    common = ["--database-url", postgres_url]
    with (
        gateway(tmp_path, *common, "--gateway-id", "gateway-a") as a,
        gateway(tmp_path, *common, "--gateway-id", "gateway-b") as b,
        store_reader(postgres_url) as store,
    ):
        lines = [chat_line(f"c{i}", 400, ignore_eos=True) for i in range(num_requests)]
        batch_id = create_openai_batch(b, lines)  # B is woken at once; A polls once a second

        def running_on_b() -> list[Any]:
            rows = request_rows(store, batch_id)
            if any(r.status == "queued" for r in rows) or not batch_running_in_engine(b):
                return []
            return [r for r in rows if r.status == "leased" and r.lease_owner == "gateway-b"]

        on_b = wait_until(running_on_b, 120, "the batch running on gateway B")
        succeeded_before = sum(r.status == "succeeded" for r in request_rows(store, batch_id))

        canceled = httpx.post(f"{a.url}/v1/batches/{batch_id}/cancel", timeout=60)
        assert canceled.status_code == 200, canceled.text
        assert canceled.json()["status"] in ("cancelling", "cancelled")
        ended = wait_until(
            lambda: (batch := openai_batch(a, batch_id))["status"] == "cancelled" and batch,
            60,
            "the batch cancelled",
            every=0.2,
        )
        wait_until(lambda: batch_running_in_engine(b) == 0, 30, "B's engine free of the batch")

        rows = request_rows(store, batch_id)
        by_idx = {r.idx: r for r in rows}
        assert all(by_idx[r.idx].status == "canceled" for r in on_b), rows
        assert all(by_idx[r.idx].result is None for r in on_b), rows
        assert sum(r.status == "succeeded" for r in rows) == succeeded_before, rows
        assert {r.status for r in rows} <= {"succeeded", "canceled"}, rows
        assert committed(b, "canceled") == len(on_b)  # B ended its own requests
        assert committed(b, "succeeded") == 0 and committed(a, "succeeded") == 0
        counts = ended["request_counts"]
        assert counts["total"] == num_requests
        assert counts["completed"] == succeeded_before
        assert counts["completed"] + counts["failed"] == num_requests


# -- 4. a graceful SIGTERM mid-batch --------------------------------------------------------


def test_sigterm_mid_batch_gives_the_leases_back_and_another_gateway_finishes_the_batch(
    tmp_path: Path,
) -> None:
    """SIGTERM a gateway while a batch runs: it shuts down (its engine too) having committed
    what it finished and given back every lease (each request is succeeded with its result,
    or queued again with none); a second gateway on the same store finishes the batch with
    exactly one result per request, the earlier results untouched."""
    num_requests = 12
    data_dir = tmp_path / "data"
    requests = [
        {
            "custom_id": f"term-{i}",
            "params": {
                "model": MODEL,
                "max_tokens": 24,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            },
        }
        for i in range(num_requests)
    ]
    with store_reader(sqlite_url(data_dir)) as store:
        with gateway(tmp_path, "--gateway-id", "gateway-1", data_dir=data_dir) as first:
            created = httpx.post(
                f"{first.url}/v1/messages/batches", json={"requests": requests}, timeout=60
            )
            assert created.status_code == 200, created.text
            batch_id = created.json()["id"]

            def mid_batch() -> list[Any]:
                rows = request_rows(store, batch_id)
                done = sum(r.status == "succeeded" for r in rows)
                running = sum(r.status == "leased" for r in rows)
                return rows if done >= 2 and running >= 1 else []

            wait_until(mid_batch, 180, "some requests done and some running", every=0.02)
            engine_pid = first.engine_pid()
            first.process.send_signal(signal.SIGTERM)
            # Graceful: the lifespan's shutdown ran; then uvicorn re-raises the signal.
            assert first.process.wait(timeout=60) in (0, -signal.SIGTERM)
            assert "Application shutdown complete" in first.log.read_text()
            wait_until(lambda: process_is_gone(engine_pid), 30, "the engine gone with it")

        rows = request_rows(store, batch_id)
        assert all(r.lease_owner is None for r in rows), rows  # no lease held by the dead one
        assert {r.status for r in rows} <= {"succeeded", "queued"}, rows
        assert all((r.status == "succeeded") == (r.result is not None) for r in rows), rows
        assert any(r.status == "queued" for r in rows), "SIGTERM came too late to mean much"
        done_first = {r.idx: r.result for r in rows if r.status == "succeeded"}
        assert len(done_first) >= 2

        with gateway(tmp_path, "--gateway-id", "gateway-2", data_dir=data_dir) as second:
            batch = wait_until(
                lambda: (
                    (b := message_batch(second, batch_id))["processing_status"] == "ended" and b
                ),
                240,
                "the batch ended on the second gateway",
                every=0.2,
            )
            assert batch["request_counts"]["succeeded"] == num_requests, batch
            # The second gateway ran only what the first had not committed.
            assert committed(second, "succeeded") == num_requests - len(done_first)
            results = httpx.get(
                f"{second.url}/v1/messages/batches/{batch_id}/results", timeout=HTTP_TIMEOUT_S
            )
            lines = [json.loads(line) for line in results.text.splitlines()]
        expected_ids = sorted(f"term-{i}" for i in range(num_requests))
        assert sorted(line["custom_id"] for line in lines) == expected_ids
        assert all(line["result"]["type"] == "succeeded" for line in lines), lines
        rows = request_rows(store, batch_id)
        assert all(r.status == "succeeded" for r in rows), rows
        assert {r.idx: r.result for r in rows if r.idx in done_first} == done_first
        assert all(r.attempts == 1 for r in rows if r.idx in done_first), rows


# -- 5. a request whose engine dies on every attempt ----------------------------------------


def test_a_request_whose_engine_dies_on_every_attempt_ends_errored_and_the_rest_succeed(
    tmp_path: Path,
) -> None:
    """The test SIGKILLs the engine each time one request ("poison") is leased. With one
    sequence slot (--max-num-seqs 1) that request is the only one in flight then. After
    max_attempts (3) leases it ends errored with the 503 the engine's death gave, in the
    OpenAI error shape, in the batch's error file; the others succeed."""
    data_dir = tmp_path / "data"
    lines = [chat_line(f"ok-{i}", 3) for i in range(3)]
    lines.insert(1, chat_line("poison", 300, ignore_eos=True))  # long: killed while it runs
    with (
        gateway(tmp_path, "--max-num-seqs", "1", data_dir=data_dir) as server,
        store_reader(sqlite_url(data_dir)) as store,
    ):
        batch_id = create_openai_batch(server, lines)

        def poison() -> Any:
            return next(r for r in request_rows(store, batch_id) if r.custom_id == "poison")

        def leased_for(attempt: int) -> bool:
            row = poison()
            return bool(row.status == "leased" and row.attempts == attempt)

        for attempt in (1, 2, 3):
            wait_until(
                partial(leased_for, attempt),
                240,
                f"the poison request leased for attempt {attempt}",
                every=0.02,
            )
            engine_pid = server.engine_pid()
            os.kill(engine_pid, signal.SIGKILL)
            wait_until(lambda: poison().status != "leased", 60, f"attempt {attempt} released")

        batch = wait_until(
            lambda: (b := openai_batch(server, batch_id))["status"] == "completed" and b,
            240,
            "the batch completed",
            every=0.2,
        )
        assert batch["request_counts"] == {"total": 4, "completed": 3, "failed": 1}, batch
        row = poison()
        assert (row.status, row.attempts) == ("errored", 3), row

        [failed] = file_lines(server, batch["error_file_id"])
        assert failed["custom_id"] == "poison" and failed["error"] is None, failed
        assert failed["response"]["status_code"] == 503, failed
        error = failed["response"]["body"]["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_unavailable"), error
        assert error["message"], error
        outputs = file_lines(server, batch["output_file_id"])
        assert sorted(o["custom_id"] for o in outputs) == ["ok-0", "ok-1", "ok-2"]
        for output in outputs:
            assert output["response"]["status_code"] == 200, output
            assert output["response"]["body"]["choices"][0]["message"]["content"], output
        assert all(r.attempts == 1 for r in request_rows(store, batch_id) if r.idx != row.idx)
        server.wait_healthy(timeout=150)  # and the gateway serves on with a fourth engine
        assert message(server).status_code == 200
