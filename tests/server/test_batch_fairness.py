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
KEY_A, KEY_B, KEY_C = "key-a-large-job", "key-b-small-job", "key-c-of-as-group"


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


def test_a_key_groups_keys_share_its_quotas_fixed_runner(tmp_path: Path) -> None:
    """Keys A and C are one group: C's create counts A's queued requests, and C's upload A's
    stored bytes; key B, a group of its own, has its own quotas. Over a quota: a 429 in
    each API's rate-limit format."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} team\n{KEY_C} team\n{KEY_B}\n")
    args = ["--runner", "fixed", "--api-keys-file", str(keys), "--max-num-seqs", "1"]
    args += ["--max-queued-batch-requests", "5", "--max-stored-file-bytes", "2000"]
    with (
        live_server(tmp_path, *args) as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        first = create(http, KEY_A, 4, 2000, "first")  # still queued at the next creates
        over = http.post(
            "/v1/messages/batches",
            content=create_body(2, 4, "over"),
            headers={"x-api-key": KEY_C, "content-type": "application/json"},
        )
        assert over.status_code == 429, over.text
        assert over.json()["error"]["type"] == "rate_limit_error"
        assert "quota of 5" in over.json()["error"]["message"]
        create(http, KEY_C, 1, 4, "fits")  # 4 + 1: within the group's quota
        create(http, KEY_B, 5, 4, "b")  # another group's quota is its own

        def upload(key: str, num_bytes: int) -> httpx.Response:
            return http.post(
                "/v1/files",
                files={"file": ("in.jsonl", b"x" * num_bytes)},
                data={"purpose": "batch"},
                headers={"authorization": f"Bearer {key}"},
            )

        kept = upload(KEY_C, 1500)
        assert kept.status_code == 200, kept.text
        refused = upload(KEY_A, 600)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert "over your quota of 2000" in error["message"]
        assert upload(KEY_B, 600).status_code == 200  # another group's bytes
        files = http.get("/v1/files", headers={"authorization": f"Bearer {KEY_A}"}).json()
        assert files["data"] == []  # the refused upload left nothing behind
        deleted = http.delete(
            f"/v1/files/{kept.json()['id']}", headers={"authorization": f"Bearer {KEY_C}"}
        )
        assert deleted.status_code == 200, deleted.text
        assert upload(KEY_A, 600).status_code == 200  # room freed by the group's delete
        http.post(f"/v1/messages/batches/{first['id']}/cancel", headers={"x-api-key": KEY_A})
