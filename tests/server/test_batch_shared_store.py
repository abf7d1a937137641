"""Two gateways sharing one real PostgreSQL store run batches together, and no request
runs twice: every request was leased exactly once, and the two gateways' committed results
add up to the batches. Both run the fixed-token runner (plumbing at a scale that makes the
two dispatchers contend for rows; the outputs do not matter)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text
from support.live_server import MODEL, LiveServer, live_server

from tokenfleet.batch.store import engine_url

pytestmark = [pytest.mark.slow, pytest.mark.fake("runner")]

NUM_REQUESTS = 3000  # in two batches, one created on each gateway
HTTP_TIMEOUT_S = 60  # a server busy with thousands of requests still answers; only a hang fails


def succeeded_count(server: LiveServer) -> float:
    text_ = httpx.get(f"{server.url}/metrics", timeout=HTTP_TIMEOUT_S).text
    for line in text_.splitlines():
        if line.startswith('tokenfleet_batch_results_total{outcome="succeeded"}'):
            return float(line.split()[-1])
    return 0.0


def create_batch(server: LiveServer, ids: range) -> str:
    body = {
        "requests": [
            {
                "custom_id": f"r{i}",
                "params": {
                    "model": MODEL,
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"Item {i}"}],
                },
            }
            for i in ids
        ]
    }
    created = httpx.post(f"{server.url}/v1/messages/batches", json=body, timeout=120)
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def test_fixed_runner_two_gateways_on_one_postgresql_never_run_a_request_twice(
    tmp_path: Path, postgres_url: str
) -> None:
    """Each gateway creates one batch of half the requests: a create wakes its own
    gateway's dispatcher at once (an idle one looks for work only once a second), so both
    take part whatever the machine's speed: each leases from the shared queue while it
    holds over a thousand requests, far more than a gateway has in flight (64)."""
    common = ["--runner", "fixed", "--database-url", postgres_url, "--max-num-seqs", "64"]
    with (
        live_server(tmp_path, *common, "--gateway-id", "gateway-a") as a,
        live_server(tmp_path, *common, "--gateway-id", "gateway-b") as b,
    ):
        half = NUM_REQUESTS // 2
        batches = {
            create_batch(a, range(half)): range(half),
            create_batch(b, range(half, NUM_REQUESTS)): range(half, NUM_REQUESTS),
        }
        for batch_id, ids in batches.items():
            deadline = time.monotonic() + 300
            for server in (a, b):  # each gateway sees both batches
                while True:
                    url = f"{server.url}/v1/messages/batches/{batch_id}"
                    batch = httpx.get(url, timeout=HTTP_TIMEOUT_S).json()
                    if batch["processing_status"] == "ended":
                        break
                    assert time.monotonic() < deadline, batch
                    time.sleep(0.5)
                assert batch["request_counts"]["succeeded"] == len(ids)
            results = httpx.get(
                f"{a.url}/v1/messages/batches/{batch_id}/results", timeout=HTTP_TIMEOUT_S
            )
            assert sorted(json.loads(line)["custom_id"] for line in results.text.splitlines()) == (
                sorted(f"r{i}" for i in ids)
            )
        by_a, by_b = succeeded_count(a), succeeded_count(b)
        assert by_a > 0 and by_b > 0, (by_a, by_b)  # both gateways did part of the work
        assert by_a + by_b == NUM_REQUESTS  # and no request was run and committed twice

    engine = create_engine(engine_url(postgres_url))
    with engine.connect() as conn:
        attempts = conn.execute(
            text("SELECT attempts, count(*) FROM batch_requests GROUP BY attempts")
        ).all()
    engine.dispose()
    assert attempts == [(1, NUM_REQUESTS)]  # each request leased exactly once
