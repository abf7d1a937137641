"""A 100,000-request batch through a real `tokenfleet serve`, with the fixed-token runner
(every step answers one fixed token without running the model) so that it fits in CI: the
gateway, store, dispatcher and engine process run for real at full scale. 100,001 requests
are refused whole first."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.live_server import MODEL, live_server

# 100,000 requests through the whole path take minutes on a busy 2-core machine: this
# module's limit is above the suite's 300 s and below its own polled 900 s deadline.
pytestmark = [pytest.mark.slow, pytest.mark.fake("runner"), pytest.mark.timeout(840)]

LIMIT = 100_000


def create_body(num: int) -> Iterator[bytes]:
    yield b'{"requests": ['
    for i in range(num):
        item = {
            "custom_id": f"req-{i}",
            "params": {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": f"Question {i}?"}],
            },
        }
        yield (b"," if i else b"") + json.dumps(item).encode()
    yield b"]}"


def test_100k_request_batch_with_the_fixed_token_runner_gives_exactly_one_result_each(
    tmp_path: Path,
) -> None:
    with (
        live_server(tmp_path, "--runner", "fixed", "--max-num-seqs", "256") as server,
        httpx.Client(base_url=server.url, timeout=600) as http,
    ):
        too_many = http.post("/v1/messages/batches", content=create_body(LIMIT + 1))
        assert too_many.status_code == 400
        assert too_many.json()["error"]["message"] == (
            f"requests[{LIMIT}]: a batch holds at most {LIMIT} requests"
        )
        assert http.get("/v1/messages/batches").json()["data"] == []  # nothing accepted

        created = http.post("/v1/messages/batches", content=create_body(LIMIT))
        assert created.status_code == 200, created.text
        batch = created.json()
        # Every request counted; some may have run already (the dispatcher starts on the
        # commit, before this answer is read back).
        counts = batch["request_counts"]
        assert counts["processing"] + counts["succeeded"] == LIMIT, counts
        assert counts["errored"] == counts["canceled"] == counts["expired"] == 0, counts
        deadline = time.monotonic() + 900
        while batch["processing_status"] != "ended":
            assert time.monotonic() < deadline, batch
            time.sleep(1)
            batch = http.get(f"/v1/messages/batches/{batch['id']}").json()
        assert batch["request_counts"] == {
            "processing": 0,
            "succeeded": LIMIT,
            "errored": 0,
            "canceled": 0,
            "expired": 0,
        }

        seen: list[str] = []
        with http.stream("GET", f"/v1/messages/batches/{batch['id']}/results") as results:
            for line in results.iter_lines():
                item = json.loads(line)
                assert item["result"]["type"] == "succeeded"
                message = item["result"]["message"]
                assert message["usage"]["output_tokens"] == 2
                assert message["content"][0]["text"] == " a a"  # the fixed token, twice
                seen.append(item["custom_id"])
        assert seen == [f"req-{i}" for i in range(LIMIT)]  # in order, each exactly once
