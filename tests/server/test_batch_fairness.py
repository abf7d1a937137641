"""Batch capacity shared across API keys, through a real `tokenfleet serve` with the
fixed-token runner (every step answers one fixed token without running the model) and two
keys (`--api-keys-file`): key B's 10-request job, submitted while key A's large job runs,
ends while A's job is still running (in deadline order alone, B's later deadline would put
it behind all of A's). And a create over a key's quota of queued requests is a 429 in each
API's format.

How long B takes beside A against alone (issue 29's pass mark, 2x) is a timing, so it is
measured by bench/batch_fairness.py (docs/reliability.md has its figures), not asserted here.
A's job here is A_REQUESTS long, so that the test stays within about a minute and a half.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.live_server import MODEL, live_server

pytestmark = [pytest.mark.slow, pytest.mark.fake("runner")]

A_REQUESTS = 20_000
B_REQUESTS = 10
REPEATS = 3
KEY_A, KEY_B = "key-a-large-job", "key-b-small-job"


def create_body(num: int, max_tokens: int, tag: str) -> Iterator[bytes]:
    yield b'{"requests": ['
    for i in range(num):
        item = {
            "custom_id": f"{tag}-{i}",
            "params": {
                "model": MODEL,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Question {i}?"}],
            },
        }
        yield (b"," if i else b"") + json.dumps(item).encode()
    yield b"]}"


def create(http: httpx.Client, key: str, num: int, max_tokens: int, tag: str) -> dict[str, Any]:
    response = http.post(
        "/v1/messages/batches",
        content=create_body(num, max_tokens, tag),
        headers={"x-api-key": key, "content-type": "application/json"},
    )
    assert response.status_code == 200, response.text
    batch: dict[str, Any] = response.json()
    return batch


def get(http: httpx.Client, key: str, batch_id: str) -> dict[str, Any]:
    batch: dict[str, Any] = http.get(
        f"/v1/messages/batches/{batch_id}", headers={"x-api-key": key}
    ).json()
    return batch


def small_job(http: httpx.Client, tag: str) -> float:
    """Seconds from key B's create until its batch is ended, every request succeeded."""
    t0 = time.monotonic()
    batch = create(http, KEY_B, B_REQUESTS, 64, tag)
    while batch["processing_status"] != "ended":
        assert time.monotonic() - t0 < 120, batch  # only catches a hang
        time.sleep(0.01)
        batch = get(http, KEY_B, batch["id"])
    took = time.monotonic() - t0
    assert batch["request_counts"]["succeeded"] == B_REQUESTS, batch
    return took


def test_fixed_runner_a_small_job_of_another_key_ends_while_a_large_job_runs(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    args = ["--runner", "fixed", "--max-num-seqs", "256", "--api-keys-file", str(keys)]
    with (
        live_server(tmp_path, *args) as server,
        httpx.Client(base_url=server.url, timeout=600) as http,
    ):
        small_job(http, "warm-up")
        alone = [small_job(http, f"alone-{r}") for r in range(REPEATS)]

        big = create(http, KEY_A, A_REQUESTS, 4, "a")
        deadline = time.monotonic() + 120
        while get(http, KEY_A, big["id"])["request_counts"]["succeeded"] < 200:
            assert time.monotonic() < deadline, "key A's job does not run"
            time.sleep(0.05)
        beside = []
        for r in range(REPEATS):
            beside.append(small_job(http, f"beside-{r}"))
            # A's job was running all along (else the comparison proves nothing).
            assert get(http, KEY_A, big["id"])["request_counts"]["processing"] > 0
        http.post(f"/v1/messages/batches/{big['id']}/cancel", headers={"x-api-key": KEY_A})

    ratio = statistics.median(beside) / statistics.median(alone)
    print(f"key B alone {alone} s, beside key A's {A_REQUESTS} {beside} s: {ratio:.2f}x")


def test_a_create_over_the_keys_queued_quota_is_a_429_in_each_apis_format_fixed_runner(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    args = ["--runner", "fixed", "--api-keys-file", str(keys)]
    args += ["--max-queued-batch-requests", "5", "--max-num-seqs", "1"]
    with (
        live_server(tmp_path, *args) as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        # Long requests on one sequence slot: the first batch is still queued at the second.
        first = create(http, KEY_A, 4, 2000, "first")
        over = http.post(
            "/v1/messages/batches",
            content=create_body(2, 4, "over"),
            headers={"x-api-key": KEY_A, "content-type": "application/json"},
        )
        assert over.status_code == 429, over.text
        assert over.json()["type"] == "error" and "quota of 5" in over.json()["error"]["message"]
        assert over.headers["retry-after"]
        create(http, KEY_B, 5, 4, "b")  # another key's quota is its own

        lines = "\n".join(
            json.dumps(
                {
                    "custom_id": f"o-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                }
            )
            for i in range(2)
        )
        auth = {"authorization": f"Bearer {KEY_A}"}
        uploaded = http.post(
            "/v1/files",
            files={"file": ("in.jsonl", lines.encode())},
            data={"purpose": "batch"},
            headers=auth,
        )
        assert uploaded.status_code == 200, uploaded.text
        refused = http.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
            headers=auth,
        )
        assert refused.status_code == 429, refused.text
        assert "quota of 5" in refused.json()["error"]["message"], refused.json()
        http.post(f"/v1/messages/batches/{first['id']}/cancel", headers={"x-api-key": KEY_A})
