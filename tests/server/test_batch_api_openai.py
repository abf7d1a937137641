"""The OpenAI Files and Batches API over a real `tokenfleet serve` process, through the
official `openai` client (sync and async): each batch answer equals the sync API's greedy
answer to the same body, result files in input order, cancel, input refused line by line
with nothing stored, limits, ownership by API key, idempotency. Then the result files of
a batch ended every way, rendered from a real SQLite store."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server

from tokenfleet.batch.schema import BatchRow, NewBatch, NewRequest
from tokenfleet.batch.store import BatchStore
from tokenfleet.server.dispatcher import ResultFormats
from tokenfleet.server.errors import APIError
from tokenfleet.server.openai_batches import batch_status
from tokenfleet.server.openai_result_files import file_id, register, result_line

live = pytest.mark.slow

KEY_A, KEY_B, KEY_C = "key-a", "key-b", "key-c"  # C: a namespace of its own for file listing
MAX_REQUESTS = 30
MAX_BYTES = 32 << 10
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
ENDED = ("completed", "failed", "expired", "cancelled")
EOS_CHAT = [{"role": "user", "content": "What is 2+2?"}]
LONG_CHAT = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


# -- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openai-batches-data")


@pytest.fixture(scope="module")
def server(
    model_folder: Path, tmp_path_factory: pytest.TempPathFactory, data_dir: Path
) -> Iterator[LiveServer]:
    args = ["--api-key", KEY_A, "--api-key", KEY_B, "--api-key", KEY_C]
    args += ["--max-batch-requests", str(MAX_REQUESTS), "--max-batch-bytes", str(MAX_BYTES)]
    args += ["--data-dir", str(data_dir)]
    tmp = tmp_path_factory.mktemp("openai-batches")
    with live_server(tmp, *args, model_folder=model_folder) as s:
        yield s


def _client(server: LiveServer, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _chat(messages: list[dict[str, str]], max_tokens: int, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return body | fields


def _line(custom_id: str, body: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def _upload(client: openai.OpenAI, lines: list[Any], name: str = "input.jsonl") -> Any:
    return client.files.create(file=(name, _jsonl(lines)), purpose="batch")


def _wait(client: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in ENDED:
        assert time.monotonic() < deadline, f"{batch_id} still {batch.status}"
        time.sleep(0.05)
    return batch


def _file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = client.files.content(file_id).content
    assert client.files.retrieve(file_id).bytes == len(content)
    return [json.loads(line) for line in content.decode().splitlines()]


def _stored_files(data_dir: Path) -> set[str]:
    return {p.name for p in (data_dir / "files").iterdir()}


def _assert_usage(usage: dict[str, Any], expected: Any) -> None:
    assert usage["prompt_tokens"] == expected.prompt_tokens
    assert usage["completion_tokens"] == expected.completion_tokens
    assert usage["total_tokens"] == expected.total_tokens


# -- a batch's answers are the sync API's -----------------------------------------------------


@live
def test_chat_batch_outputs_equal_the_sync_api(server: LiveServer) -> None:
    client = _client(server)
    bodies = [_chat(EOS_CHAT, 24), _chat(LONG_CHAT, 12), _chat(LONG_CHAT, 5, stop=["@@"])]
    lines = [_line(f"req-{i}", body) for i, body in enumerate(bodies)]
    uploaded = _upload(client, lines)
    assert uploaded.id.startswith("file-") and uploaded.object == "file"
    assert (uploaded.bytes, uploaded.filename) == (len(_jsonl(lines)), "input.jsonl")
    assert (uploaded.purpose, uploaded.status, uploaded.expires_at) == ("batch", "processed", None)

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=CHAT,
        completion_window="24h",
        metadata={"run": "chat"},
    )
    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert (batch.status, batch.endpoint, batch.input_file_id) == ("in_progress", CHAT, uploaded.id)
    assert batch.metadata == {"run": "chat"} and batch.errors is None
    assert batch.in_progress_at == batch.created_at
    assert batch.expires_at == batch.created_at + 24 * 3600

    done = _wait(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (3, 3)
    assert done.request_counts.failed == 0
    assert done.completed_at is not None and done.finalizing_at == done.completed_at
    assert done.completed_at >= done.created_at
    assert (done.failed_at, done.cancelled_at, done.cancelling_at, done.expired_at) == (None,) * 4
    output = client.files.retrieve(done.output_file_id)
    assert (output.purpose, output.filename) == ("batch_output", f"{batch.id}_output.jsonl")

    results = _file_lines(client, done.output_file_id)
    assert [r["custom_id"] for r in results] == ["req-0", "req-1", "req-2"]
    assert len({r["id"] for r in results}) == 3
    for body, result in zip(bodies, results, strict=True):
        assert result["id"].startswith("batch_req_") and result["error"] is None
        response = result["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        expected = client.chat.completions.create(**body)
        got = response["body"]
        assert got["object"] == "chat.completion" and got["model"] == MODEL
        assert got["choices"][0]["message"]["content"] == expected.choices[0].message.content
        assert got["choices"][0]["finish_reason"] == expected.choices[0].finish_reason
        _assert_usage(got["usage"], expected.usage)
    assert results[1]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert results[1]["response"]["body"]["usage"]["completion_tokens"] == 12


@live
def test_completions_batch_with_the_async_client(server: LiveServer) -> None:
    prompts = ["The capital of France is", "Once upon a time, there was"]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts]

    async def main() -> None:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY_A, max_retries=0
        ) as client:
            data = _jsonl([_line(f"p{i}", b, CMPL) for i, b in enumerate(bodies)])
            uploaded = await client.files.create(file=("prompts.jsonl", data), purpose="batch")
            batch = await client.batches.create(
                input_file_id=uploaded.id, endpoint=CMPL, completion_window="24h"
            )
            assert batch.endpoint == CMPL and batch.metadata is None
            while (batch := await client.batches.retrieve(batch.id)).status not in ENDED:
                await asyncio.sleep(0.05)
            assert batch.status == "completed" and batch.error_file_id is None
            content = (await client.files.content(batch.output_file_id)).content
            results = [json.loads(line) for line in content.decode().splitlines()]
            assert [r["custom_id"] for r in results] == ["p0", "p1"]
            for body, result in zip(bodies, results, strict=True):
                expected = await client.completions.create(**body)
                got = result["response"]["body"]
                assert got["object"] == "text_completion"
                assert got["choices"][0]["text"] == expected.choices[0].text
                assert got["choices"][0]["finish_reason"] == expected.choices[0].finish_reason
                _assert_usage(got["usage"], expected.usage)

    asyncio.run(main())


# -- files ------------------------------------------------------------------------------------


@live
def test_files_list_retrieve_content_delete(server: LiveServer, data_dir: Path) -> None:
    client = _client(server, KEY_C)
    first = _upload(client, [_line("a", _chat(EOS_CHAT, 1))], "first.jsonl")
    second = _upload(client, [_line("b", _chat(EOS_CHAT, 1))], "second.jsonl")
    assert {first.id, second.id} <= _stored_files(data_dir)

    page = client.files.list(purpose="batch")
    assert [f.id for f in page.data] == [second.id, first.id]  # newest first
    assert page.has_more is False
    page = client.files.list(limit=1)
    assert [f.id for f in page.data] == [second.id] and page.has_more is True
    assert [f.id for f in client.files.list(limit=1, after=second.id).data] == [first.id]
    assert client.files.list(purpose="batch_output").data == []
    raw = httpx.get(
        f"{server.url}/v1/files",
        headers={"authorization": f"Bearer {KEY_C}"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert raw.json()["object"] == "list"
    assert (raw.json()["first_id"], raw.json()["last_id"]) == (second.id, first.id)

    assert client.files.retrieve(first.id) == first
    assert client.files.content(first.id).content == _jsonl([_line("a", _chat(EOS_CHAT, 1))])

    deleted = client.files.delete(first.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (first.id, "file", True)
    assert first.id not in _stored_files(data_dir)
    with pytest.raises(openai.NotFoundError, match=f"No such File object: {first.id}"):
        client.files.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(first.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(first.id)
    assert [f.id for f in client.files.list().data] == [second.id]


@live
def test_upload_purpose_other_than_batch_is_refused(server: LiveServer, data_dir: Path) -> None:
    client = _client(server, KEY_C)
    before = _stored_files(data_dir)
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "purpose"  # type: ignore[index]
    assert "'fine-tune' is not supported" in caught.value.body["message"]  # type: ignore[index]
    assert _stored_files(data_dir) == before


@live
def test_oversize_upload_is_413_and_leaves_nothing(server: LiveServer, data_dir: Path) -> None:
    client = _client(server, KEY_C)
    before, listed = _stored_files(data_dir), client.files.list().data
    # One byte over, found while streaming; and far over, refused by Content-Length alone.
    for size in (MAX_BYTES + 1, MAX_BYTES + (100 << 10)):
        with pytest.raises(openai.APIStatusError) as caught:
            client.files.create(file=("big.jsonl", b"x" * size), purpose="batch")
        assert caught.value.status_code == 413
        assert caught.value.body["code"] == "request_too_large"  # type: ignore[index]
    assert _stored_files(data_dir) == before
    assert client.files.list().data == listed
    exact = client.files.create(file=("full.jsonl", b"x" * MAX_BYTES), purpose="batch")
    assert exact.bytes == MAX_BYTES
    client.files.delete(exact.id)


# -- cancel -----------------------------------------------------------------------------------


@live
def test_cancel_leaves_one_line_per_request_across_the_two_files(server: LiveServer) -> None:
    """The cancel is sent once the three 2-token requests have completed (the event it
    waits for); the other 27 need 300 tokens each, hundreds of engine steps more than the
    cancel's one round trip, so every one of them is cut, whatever the machine's speed."""
    client = _client(server)
    lines = [
        _line(f"c{i}", _chat(LONG_CHAT, 2 if i < 3 else 300, ignore_eos=True))
        for i in range(MAX_REQUESTS)
    ]
    batch = client.batches.create(
        input_file_id=_upload(client, lines).id, endpoint=CHAT, completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 3:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    canceling = client.batches.cancel(batch.id)
    assert canceling.status in ("cancelling", "cancelled")
    assert canceling.cancelling_at is not None

    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.completed_at is None and done.cancelling_at == canceling.cancelling_at
    output = _file_lines(client, done.output_file_id)
    errors = _file_lines(client, done.error_file_id)
    order = [line["custom_id"] for line in lines]
    assert sorted(order.index(r["custom_id"]) for r in output + errors) == list(range(30))
    for results in (output, errors):  # each in input order
        idxs = [order.index(r["custom_id"]) for r in results]
        assert idxs == sorted(idxs)
    assert [r["custom_id"] for r in output] == ["c0", "c1", "c2"]  # done before the cancel
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in output)
    assert len(errors) == MAX_REQUESTS - 3  # every long one, queued or running, was cut
    for r in errors:
        assert r["response"] is None
        assert r["error"]["code"] == "batch_cancelled"
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (30, len(output), len(errors))
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no change


# -- input refused line by line: a failed batch, nothing stored ------------------------------

GOOD = _line("ok", _chat(EOS_CHAT, 1))


@live
@pytest.mark.parametrize(
    ("lines", "line", "param", "code", "text"),
    [
        ([GOOD, '{"custom_id": "x", "url": ', GOOD], 2, None, "invalid_request", "malformed JSON"),
        (
            [GOOD, _line("dup", _chat(EOS_CHAT, 1)), _line("dup", _chat(EOS_CHAT, 1))],
            3,
            "custom_id",
            "invalid_request",
            "custom_id 'dup' appears twice in the batch",
        ),
        (
            [GOOD, _line("u", _chat(EOS_CHAT, 1), "/v1/embeddings")],
            2,
            "url",
            "invalid_request",
            "url '/v1/embeddings' differs from the batch's endpoint '/v1/chat/completions'",
        ),
        (
            [_line("m", {**_chat(EOS_CHAT, 1), "model": "gpt-nope"}), GOOD],
            1,
            "body.model",
            "model_not_found",
            "gpt-nope",
        ),
        (
            [GOOD, _line("s", {**_chat(EOS_CHAT, 1), "stream": True})],
            2,
            "body.stream",
            "invalid_request",
            "stream is not supported in a batch",
        ),
        (
            [_line(f"n{i}", _chat(EOS_CHAT, 1)) for i in range(MAX_REQUESTS + 1)],
            MAX_REQUESTS + 1,
            None,
            "invalid_request",
            f"a batch holds at most {MAX_REQUESTS} requests",
        ),
    ],
    ids=[
        "malformed-json",
        "duplicate-custom-id",
        "other-url",
        "unknown-model",
        "stream",
        "over-max-requests-fast-version",
    ],
)
def test_bad_line_fails_the_batch_naming_it(
    server: LiveServer, lines: list[Any], line: int, param: str | None, code: str, text: str
) -> None:
    client = _client(server)
    batch = client.batches.create(
        input_file_id=_upload(client, lines).id, endpoint=CHAT, completion_window="24h"
    )
    assert batch.status == "failed"
    assert batch.failed_at is not None and batch.failed_at >= batch.created_at
    assert (batch.in_progress_at, batch.output_file_id, batch.error_file_id) == (None,) * 3
    assert batch.request_counts is not None and batch.request_counts.total == 0
    assert batch.errors is not None and batch.errors.object == "list"
    [error] = batch.errors.data  # type: ignore[misc]
    assert (error.line, error.param, error.code) == (line, param, code)
    where = f"line {line}" + (f", {param}" if param else "")
    assert error.message is not None and error.message.startswith(f"{where}: ")
    assert text in error.message
    assert client.batches.retrieve(batch.id) == batch  # stored as it was answered


@live
def test_empty_input_file_fails_the_batch(server: LiveServer) -> None:
    client = _client(server)
    batch = client.batches.create(
        input_file_id=_upload(client, ["", "  "]).id, endpoint=CHAT, completion_window="24h"
    )
    assert batch.status == "failed" and batch.errors is not None
    [error] = batch.errors.data  # type: ignore[misc]
    assert (error.line, error.message) == (None, "the input file has no requests")


@live
def test_create_errors_name_the_field(server: LiveServer) -> None:
    client = _client(server)
    good = _upload(client, [GOOD]).id

    def refused(status: int, **fields: Any) -> dict[str, Any]:
        create = {"input_file_id": good, "endpoint": CHAT, "completion_window": "24h"} | fields
        with pytest.raises(openai.APIStatusError) as caught:
            client.batches.create(**create)
        assert caught.value.status_code == status
        return caught.value.body  # type: ignore[return-value]

    assert refused(400, endpoint="/v1/embeddings")["param"] == "endpoint"
    assert refused(400, endpoint="/v1/messages")["param"] == "endpoint"
    error = refused(400, completion_window="48h")
    assert error["param"] == "completion_window" and "'48h' is not supported" in error["message"]
    many = {f"k{i}": "v" for i in range(17)}
    assert refused(400, metadata=many)["param"] == "metadata"
    error = refused(404, input_file_id="file-nope")
    assert error["message"] == "No such File object: file-nope"
    assert error["param"] == "input_file_id"
    # A batch's output file is no input.
    done = _wait(
        client,
        client.batches.create(input_file_id=good, endpoint=CHAT, completion_window="24h").id,
    )
    assert refused(400, input_file_id=done.output_file_id)["param"] == "input_file_id"
    assert [b.id for b in client.batches.list(limit=1).data] == [done.id]  # nothing else stored


# -- ownership and idempotency ---------------------------------------------------------------


@live
def test_files_and_batches_belong_to_their_key(server: LiveServer) -> None:
    a, b = _client(server, KEY_A), _client(server, KEY_B)
    uploaded = _upload(a, [GOOD])
    batch = a.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    for call in (
        lambda: b.files.retrieve(uploaded.id),
        lambda: b.files.content(uploaded.id),
        lambda: b.files.delete(uploaded.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert uploaded.id not in {f.id for f in b.files.list().data}
    assert batch.id not in {x.id for x in b.batches.list().data}
    done = _wait(a, batch.id)  # A's batch is untouched, and its output file A's alone
    assert done.status == "completed"
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)
    assert a.files.retrieve(uploaded.id).id == uploaded.id
    no_key = httpx.get(f"{server.url}/v1/files/{uploaded.id}", timeout=HTTP_TIMEOUT_S)
    assert no_key.status_code == 401


@live
def test_idempotency_key_returns_the_same_batch(server: LiveServer) -> None:
    client = _client(server)
    input_id = _upload(client, [GOOD]).id

    def create(key: str) -> Any:
        return client.batches.create(
            input_file_id=input_id,
            endpoint=CHAT,
            completion_window="24h",
            extra_headers={"Idempotency-Key": key},
        )

    first = create("retry-1")
    assert create("retry-1").id == first.id
    other = create("retry-2")
    assert other.id != first.id
    assert {_wait(client, first.id).status, _wait(client, other.id).status} == {"completed"}
    ids = [b.id for b in client.batches.list(limit=3).data]
    assert ids[:2] == [other.id, first.id]


@live
def test_batches_list_pages_newest_first(server: LiveServer) -> None:
    client = _client(server, KEY_B)
    input_id = _upload(client, [GOOD, "not json"]).id  # failed batches: nothing to run
    ids = [
        client.batches.create(input_file_id=input_id, endpoint=CHAT, completion_window="24h").id
        for _ in range(3)
    ]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == [ids[2], ids[1]] and page.has_more is True
    page = client.batches.list(limit=2, after=ids[1])
    assert [b.id for b in page.data] == [ids[0]] and page.has_more is False
    assert [b.id for b in client.batches.list()] == ids[::-1]  # the client's auto-paging


# -- result files, rendered from the store (no server) ----------------------------------------


def test_result_files_of_a_batch_that_ended_every_way(tmp_path: Path) -> None:
    store = BatchStore(f"sqlite:///{tmp_path / 'b.db'}")
    batch = NewBatch(
        id="batch_x", api="openai", owner="o", endpoint=CHAT, created_at=10.0, expires_at=100.0
    )
    store.create_batch(batch, [NewRequest(f"r{i}", "{}") for i in range(4)])
    ok, failed = store.lease("g", 2, 60.0, 11.0)  # r2, r3 stay queued
    formats = ResultFormats()
    body = {"id": "chatcmpl-1", "choices": []}
    store.complete(
        "batch_x", ok.idx, ok.epoch, "succeeded", formats.success("openai", CHAT, body), 12.0
    )
    error = formats.error("openai", CHAT, APIError(400, "invalid_request", "bad", param="x"))
    store.complete("batch_x", failed.idx, failed.epoch, "errored", error, 12.0)
    store.cancel_batch("batch_x", "o", 13.0)  # r2, r3 canceled
    assert store.finish_batches(14.0) == ["batch_x"]
    assert batch_status(store.get_batch("batch_x", "o")) == "cancelling"  # files pending  # type: ignore[arg-type]

    register(store, "batch_x", 15.0)
    register(store, "batch_x", 16.0)  # again: nothing changes
    row = store.get_batch("batch_x", "o")
    assert row is not None and batch_status(row) == "cancelled"
    assert (row.output_file_id, row.error_file_id) == (
        file_id("batch_x", "output"),
        file_id("batch_x", "error"),
    )
    lines = {"output": [], "error": []}  # type: dict[str, list[str]]
    for result in store.iter_results("batch_x"):
        kind, line = result_line("batch_x", result)
        lines[kind].append(line)
    files, _ = store.list_files("o")
    by_id = {f.id: f for f in files}
    for kind, fid in (("output", row.output_file_id), ("error", row.error_file_id)):
        f = by_id[fid]
        assert (f.purpose, f.created_at, f.location) == (
            "batch_output",
            15.0,
            f"batch:batch_x:{kind}",
        )
        assert f.bytes == len("".join(lines[kind]).encode())
    output = [json.loads(x) for x in lines["output"]]
    errors = [json.loads(x) for x in lines["error"]]
    assert [x["custom_id"] for x in output] == ["r0"]
    assert output[0]["response"]["body"] == body and output[0]["error"] is None
    assert [x["custom_id"] for x in errors] == ["r1", "r2", "r3"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"] == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": None}
    }
    assert errors[0]["error"] is None
    assert [x["error"]["code"] for x in errors[1:]] == ["batch_cancelled"] * 2
    assert all(x["response"] is None for x in errors[1:])
    assert len({x["id"] for x in output + errors}) == 4
    store.close()


def _row(state: str, reason: str | None, output: str | None = None, **kw: Any) -> BatchRow:
    fields: dict[str, Any] = dict(
        id="batch_x",
        api="openai",
        owner="",
        endpoint=CHAT,
        state=state,
        ended_reason=reason,
        num_requests=1,
        created_at=1.0,
        expires_at=2.0,
        cancel_initiated_at=None,
        ended_at=None,
        archived_at=None,
        input_file_id="file-in",
        output_file_id=output,
        error_file_id=None,
        metadata="null",
        errors=None,
        idempotency_key=None,
    )
    return BatchRow(**(fields | kw))


@pytest.mark.parametrize(
    ("row", "status"),
    [
        (_row("in_progress", None), "in_progress"),
        (_row("canceling", None), "cancelling"),
        (_row("ended", "failed"), "failed"),
        (_row("ended", "completed"), "finalizing"),
        (_row("ended", "completed", "file-o"), "completed"),
        (_row("ended", "expired"), "finalizing"),
        (_row("ended", "expired", "file-o"), "expired"),
        (_row("ended", "canceled"), "cancelling"),
        (_row("ended", "canceled", "file-o"), "cancelled"),
        (_row("ended", "completed", archived_at=5.0), "completed"),
    ],
)
def test_batch_status_is_terminal_only_once_its_files_exist(row: BatchRow, status: str) -> None:
    assert batch_status(row) == status
