"""Anthropic Message Batches on a real `tokenfleet serve`, through the official client and raw
HTTP: results equal the sync API's greedy outputs; list, cancel, delete, expiry, the 29-day
archive (a short configured window), Idempotency-Key, isolation between keys, and bad
input refused whole with the request's index named."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server

pytestmark = pytest.mark.slow

PARAMS: list[dict[str, Any]] = [
    {"max_tokens": 8, "messages": [{"role": "user", "content": "Count to 5."}]},
    {
        "max_tokens": 24,
        "system": "You are a pirate.",
        "messages": [{"role": "user", "content": "Say hello."}],
    },
    {
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "Count to 9."}],
        "stop_sequences": ["4"],
    },
]
KEY_A, KEY_B = "key-a-secret", "key-b-secret"
MAX_BATCH_BYTES = 64 * 1024  # the module's server: small, so that 413 is cheap to reach


def params(p: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0, **p}


def requests(n: int, max_tokens: int = 1, prefix: str = "r") -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"{prefix}{i}",
            "params": params(
                {"max_tokens": max_tokens, "messages": [{"role": "user", "content": f"Tell {i}."}]}
            ),
        }
        for i in range(n)
    ]


def wait_until(predicate: Callable[[], Any], timeout: float = 120, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError("condition not met in time")


def wait_ended(client: anthropic.Anthropic, batch_id: str, timeout: float = 180) -> Any:
    def ended() -> Any:
        batch = client.messages.batches.retrieve(batch_id)
        return batch if batch.processing_status == "ended" else None

    return wait_until(ended, timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # Two keys: every test calls with KEY_A; the isolation test also with KEY_B.
    tmp = tmp_path_factory.mktemp("batches")
    limit = ["--max-batch-bytes", str(MAX_BATCH_BYTES)]
    with live_server(tmp, "--api-key", KEY_A, "--api-key", KEY_B, *limit) as s:
        yield s


@pytest.fixture
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY_A, max_retries=0)


def test_batch_results_equal_the_sync_apis_greedy_messages(client: anthropic.Anthropic) -> None:
    batch = client.messages.batches.create(
        requests=[{"custom_id": f"req-{i}", "params": params(p)} for i, p in enumerate(PARAMS)]
    )
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 3
    assert (batch.expires_at - batch.created_at).total_seconds() == pytest.approx(24 * 3600)

    ended = wait_ended(client, batch.id)
    assert ended.request_counts.model_dump() == {
        "processing": 0,
        "succeeded": 3,
        "errored": 0,
        "canceled": 0,
        "expired": 0,
    }
    assert ended.ended_at is not None and ended.results_url.endswith(f"/{batch.id}/results")
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert sorted(results) == ["req-0", "req-1", "req-2"]
    for i, p in enumerate(PARAMS):
        # This client takes no temperature argument: it goes in the body as is.
        sync = client.messages.create(model=MODEL, extra_body={"temperature": 0}, **p)
        result = results[f"req-{i}"]
        assert result.type == "succeeded"
        message = result.message
        assert message.content[0].text == sync.content[0].text
        assert (message.stop_reason, message.stop_sequence) == (
            sync.stop_reason,
            sync.stop_sequence,
        )
        # The same prompt, read from the prefix cache in part or not (the sync one ran after).
        assert [
            u.input_tokens + (u.cache_read_input_tokens or 0) for u in (message.usage, sync.usage)
        ] == [sync.usage.input_tokens + (sync.usage.cache_read_input_tokens or 0)] * 2
        assert message.usage.output_tokens == sync.usage.output_tokens
    assert results["req-2"].message.stop_reason == "stop_sequence"  # type: ignore[union-attr]
    assert results["req-0"].message.stop_reason == "max_tokens"  # type: ignore[union-attr]


def test_async_client_creates_lists_and_reads_results(server: LiveServer) -> None:
    async def go() -> None:
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY_A, max_retries=0)
        batch = await client.messages.batches.create(requests=requests(2))
        while (await client.messages.batches.retrieve(batch.id)).processing_status != "ended":
            await asyncio.sleep(0.2)
        ids = [b.id async for b in client.messages.batches.list(limit=100)]
        assert batch.id in ids
        lines = [r async for r in await client.messages.batches.results(batch.id)]
        assert sorted(r.custom_id for r in lines) == ["r0", "r1"]
        assert {r.result.type for r in lines} == {"succeeded"}

    asyncio.run(go())


def test_list_pages_newest_first_with_before_and_after_ids(server: LiveServer) -> None:
    # A key of its own, so that other tests' batches do not show up here.
    with anthropic.Anthropic(base_url=server.url, api_key=KEY_B, max_retries=0) as client:
        ids = [client.messages.batches.create(requests=requests(1)).id for _ in range(3)]
        newest_first = ids[::-1]
        page = client.messages.batches.list(limit=2)
        assert [b.id for b in page.data] == newest_first[:2]
        assert (page.has_more, page.first_id, page.last_id) == (True, ids[2], ids[1])
        rest = client.messages.batches.list(limit=2, after_id=page.last_id)
        assert [b.id for b in rest.data] == newest_first[2:]
        assert rest.has_more is False
        before = client.messages.batches.list(limit=2, before_id=ids[0])
        assert [b.id for b in before.data] == newest_first[:2]
        for batch_id in ids:
            wait_ended(client, batch_id)


def test_cancel_ends_the_batch_with_one_result_per_request(client: anthropic.Anthropic) -> None:
    # Canceled right after its create returns: 300 tokens each, no request can finish in
    # the cancel's one round trip, so some are canceled whatever the machine's speed.
    batch = client.messages.batches.create(requests=requests(20, max_tokens=300))
    canceling = client.messages.batches.cancel(batch.id)
    assert canceling.cancel_initiated_at is not None
    assert canceling.processing_status in ("canceling", "ended")
    ended = wait_ended(client, batch.id)
    counts = ended.request_counts
    assert counts.processing == counts.errored == counts.expired == 0
    assert counts.succeeded + counts.canceled == 20 and counts.canceled >= 1
    lines = list(client.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in lines) == sorted(f"r{i}" for i in range(20))
    by_type = {t: sum(r.result.type == t for r in lines) for t in ("succeeded", "canceled")}
    assert by_type == {"succeeded": counts.succeeded, "canceled": counts.canceled}


def test_delete_only_once_ended_then_gone(client: anthropic.Anthropic) -> None:
    batch = client.messages.batches.create(requests=requests(4, max_tokens=32))
    with pytest.raises(anthropic.BadRequestError, match="still processing"):
        client.messages.batches.delete(batch.id)
    wait_ended(client, batch.id)
    deleted = client.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.delete(batch.id)


def test_idempotency_key_returns_the_same_batch(server: LiveServer) -> None:
    body = {"requests": requests(1)}
    headers = {"x-api-key": KEY_A, "idempotency-key": "create-once-1"}
    first = httpx.post(
        f"{server.url}/v1/messages/batches", json=body, headers=headers, timeout=HTTP_TIMEOUT_S
    )
    again = httpx.post(
        f"{server.url}/v1/messages/batches", json=body, headers=headers, timeout=HTTP_TIMEOUT_S
    )
    other = httpx.post(
        f"{server.url}/v1/messages/batches",
        json=body,
        headers={**headers, "idempotency-key": "create-once-2"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert first.status_code == again.status_code == other.status_code == 200
    assert first.json()["id"] == again.json()["id"] != other.json()["id"]


def test_another_keys_batch_is_not_found(server: LiveServer) -> None:
    a = anthropic.Anthropic(base_url=server.url, api_key=KEY_A, max_retries=0)
    b = anthropic.Anthropic(base_url=server.url, api_key=KEY_B, max_retries=0)
    batch = a.messages.batches.create(requests=requests(1))
    wait_ended(a, batch.id)
    for call in (
        lambda: b.messages.batches.retrieve(batch.id),
        lambda: b.messages.batches.cancel(batch.id),
        lambda: b.messages.batches.delete(batch.id),
        lambda: list(b.messages.batches.results(batch.id)),
    ):
        with pytest.raises(anthropic.NotFoundError):
            call()
    assert batch.id not in [x.id for x in b.messages.batches.list(limit=1000).data]
    raw = httpx.get(
        f"{server.url}/v1/messages/batches/{batch.id}/results",
        headers={"x-api-key": KEY_B},
        timeout=HTTP_TIMEOUT_S,
    )
    assert raw.status_code == 404 and raw.json()["error"]["type"] == "not_found_error"
    assert a.messages.batches.retrieve(batch.id).id == batch.id


BAD_REQUESTS = [
    (
        "duplicate custom_id",
        [*requests(2), {"custom_id": "r1", "params": params(PARAMS[0])}],
        "requests[2].custom_id",
        "appears twice",
    ),
    (
        "custom_id with a space",
        [{"custom_id": "bad id", "params": params(PARAMS[0])}],
        "requests[0].custom_id",
        "1 to 64 characters",
    ),
    (
        "custom_id too long",
        [{"custom_id": "x" * 65, "params": params(PARAMS[0])}],
        "requests[0].custom_id",
        "1 to 64 characters",
    ),
    (
        "unknown model",
        [*requests(1), {"custom_id": "m", "params": {**params(PARAMS[0]), "model": "gpt-x"}}],
        "requests[1].params.model",
        "not found",
    ),
    (
        "stream inside a batch",
        [{"custom_id": "s", "params": {**params(PARAMS[0]), "stream": True}}],
        "requests[0].params.stream",
        "not supported",
    ),
    (
        "missing max_tokens",
        [{"custom_id": "t", "params": {"model": MODEL, "messages": PARAMS[0]["messages"]}}],
        "requests[0].params.max_tokens",
        "Field required",
    ),
    (
        "max_tokens of the wrong type",
        [{"custom_id": "t", "params": {**params(PARAMS[0]), "max_tokens": "8"}}],
        "requests[0].params.max_tokens",
        "integer",
    ),
    (
        "prompt plus max_tokens over the context",
        [{"custom_id": "t", "params": {**params(PARAMS[0]), "max_tokens": 10**6}}],
        "requests[0].params.max_tokens",
        "over the context length",
    ),
    (
        "extended thinking, which this server does not serve",
        [
            *requests(1),
            {
                "custom_id": "u",
                "params": {
                    **params(PARAMS[0]),
                    "thinking": {"type": "enabled", "budget_tokens": 9},
                },
            },
        ],
        "requests[1].params.thinking",
        "extended thinking is not supported",
    ),
    ("no requests", [], "requests", "at least one"),
]


@pytest.mark.parametrize(
    ("case", "body_requests", "where", "message"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_input_is_refused_whole_naming_the_request(
    server: LiveServer, case: str, body_requests: list[Any], where: str, message: str
) -> None:
    headers = {"x-api-key": KEY_A}
    before = batch_ids(server, headers)
    response = httpx.post(
        f"{server.url}/v1/messages/batches",
        json={"requests": body_requests},
        headers=headers,
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(where + ":"), error
    assert message in error["error"]["message"]
    assert response.headers["request-id"].startswith("req_")
    assert batch_ids(server, headers) == before  # nothing accepted


def test_malformed_json_body_is_a_400(server: LiveServer) -> None:
    response = httpx.post(
        f"{server.url}/v1/messages/batches",
        content=b'{"requests": [{"custom_id": "a", "params": {',
        headers={"x-api-key": KEY_A, "content-type": "application/json"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 400
    assert "malformed JSON" in response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200


def test_a_body_over_the_batch_size_limit_is_a_413_and_nothing_is_accepted(
    server: LiveServer,
) -> None:
    headers = {"x-api-key": KEY_A}
    before = batch_ids(server, headers)
    padding = "x" * 1000
    body = {"requests": requests(80, prefix=f"big{padding[:40]}")}
    for item in body["requests"]:
        item["params"]["metadata"] = {"user_id": padding}
    data = json.dumps(body).encode()
    assert len(data) > MAX_BATCH_BYTES
    response = httpx.post(
        f"{server.url}/v1/messages/batches",
        content=data,
        headers={**headers, "content-type": "application/json"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "request_too_large" and str(MAX_BATCH_BYTES) in error["message"]

    def chunks() -> Iterator[bytes]:  # no content-length: the limit holds while streaming
        yield data[: len(data) // 2]
        yield data[len(data) // 2 :]

    streamed = httpx.post(
        f"{server.url}/v1/messages/batches",
        content=chunks(),
        headers={**headers, "content-type": "application/json"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert streamed.status_code == 413
    assert batch_ids(server, headers) == before
    assert httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200


def batch_ids(server: LiveServer, headers: dict[str, str]) -> list[str]:
    response = httpx.get(
        f"{server.url}/v1/messages/batches?limit=1000", headers=headers, timeout=HTTP_TIMEOUT_S
    )
    return [b["id"] for b in response.json()["data"]]


# -- expiry and the archive, on servers with short configured windows and the fixed-token
# -- runner (plumbing: the outputs do not matter, only that requests are still queued)

EXPIRY_S = 3
# Results are read between the batch's end (at EXPIRY_S, plus a maintenance round) and the
# archive: a window of over 25 s, wide for a slow machine.
RETENTION_S = 30


@pytest.fixture(scope="module")
def short_windows(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("short-windows")
    windows = ["--batch-expiry", str(EXPIRY_S), "--batch-retention", str(RETENTION_S)]
    # Eight sequences at a time: a batch of hundreds of 2,000-token requests is then
    # tens of thousands of engine steps, which no machine runs within the expiry.
    with live_server(tmp, "--runner", "fixed", "--max-num-seqs", "8", *windows) as s:
        yield s


@pytest.mark.fake("runner")
def test_fixed_runner_batch_past_its_expiry_ends_with_the_rest_expired(
    short_windows: LiveServer, tmp_path: Path
) -> None:
    client = anthropic.Anthropic(base_url=short_windows.url, api_key="unused", max_retries=0)
    # Far more work than EXPIRY_S allows: 600 requests of 2,000 tokens, 8 at a time.
    batch = client.messages.batches.create(requests=requests(600, max_tokens=2000))
    ended = wait_ended(client, batch.id, timeout=120)
    counts = ended.request_counts
    assert counts.expired > 0 and counts.processing == counts.errored == counts.canceled == 0
    assert counts.succeeded + counts.expired == 600
    # Ended by the expiry: not before it, and soon after (a maintenance round runs every
    # second; the bound is wide, it only tells an expiry from a batch run to its end).
    lasted = (ended.ended_at - ended.created_at).total_seconds()
    assert EXPIRY_S <= lasted < RETENTION_S
    lines = list(client.messages.batches.results(batch.id))
    assert len({r.custom_id for r in lines}) == len(lines) == 600
    assert sum(r.result.type == "expired" for r in lines) == counts.expired

    # The archive: past the retention window after creation the results are gone.
    archived = wait_until(
        lambda: (b := client.messages.batches.retrieve(batch.id)).archived_at and b,
        timeout=RETENTION_S + 120,
    )
    assert archived.results_url is None
    assert archived.request_counts == counts  # the counts outlive the request rows
    response = httpx.get(
        f"{short_windows.url}/v1/messages/batches/{batch.id}/results", timeout=HTTP_TIMEOUT_S
    )
    assert response.status_code == 404 and "no longer kept" in response.text


@pytest.mark.fake("runner")
def test_fixed_runner_results_of_a_running_batch_are_refused(short_windows: LiveServer) -> None:
    client = anthropic.Anthropic(base_url=short_windows.url, api_key="unused", max_retries=0)
    batch = client.messages.batches.create(requests=requests(300, max_tokens=2000))
    response = httpx.get(
        f"{short_windows.url}/v1/messages/batches/{batch.id}/results", timeout=HTTP_TIMEOUT_S
    )
    assert response.status_code == 400 and "has not ended" in response.json()["error"]["message"]
    client.messages.batches.cancel(batch.id)
    wait_ended(client, batch.id, timeout=120)
    assert json.loads(
        httpx.get(
            f"{short_windows.url}/v1/messages/batches/{batch.id}", timeout=HTTP_TIMEOUT_S
        ).text
    )["processing_status"] == ("ended")
