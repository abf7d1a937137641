"""The batch store on a real SQLite file and a real PostgreSQL: every test runs on both."""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from sqlalchemy import event, func, insert, select

from tokenfleet.batch import (
    REQUEST_STATUSES,
    SCHEMA_VERSION,
    Api,
    BatchNotEnded,
    BatchRow,
    BatchStore,
    FileRow,
    NewBatch,
    NewRequest,
    Outcome,
    SchemaTooNew,
    engine_url,
)
from tokenfleet.batch.schema import batch_requests, schema_version
from tokenfleet.errors import InvalidRequestError

T0 = 1_750_000_000.0
DAY = 24 * 3600.0


def new_batch(
    batch_id: str,
    *,
    owner: str = "alice",
    api: Api = "anthropic",
    created_at: float = T0,
    expires_at: float | None = None,
    idempotency_key: str | None = None,
    errors: str | None = None,
) -> NewBatch:
    return NewBatch(
        id=batch_id,
        api=api,
        owner=owner,
        endpoint="/v1/messages" if api == "anthropic" else "/v1/chat/completions",
        created_at=created_at,
        expires_at=created_at + DAY if expires_at is None else expires_at,
        idempotency_key=idempotency_key,
        errors=errors,
    )


def new_requests(num: int, prefixes: Iterable[str] | None = None) -> Iterator[NewRequest]:
    keys = iter(prefixes) if prefixes is not None else None
    for i in range(num):
        prefix = next(keys) if keys is not None else ""
        yield NewRequest(f"req-{i}", json.dumps({"max_tokens": 8, "i": i}), prefix)


def counts(**nonzero: int) -> dict[str, int]:
    return dict.fromkeys(REQUEST_STATUSES, 0) | nonzero


def num_request_rows(store: BatchStore) -> int:
    with store.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(batch_requests)).scalar_one()


# --- creating ------------------------------------------------------------------------------


def test_create_batch_stores_the_batch_and_its_queued_requests(store: BatchStore) -> None:
    created = store.create_batch(new_batch("msgbatch_1"), new_requests(5))

    assert created == BatchRow(
        id="msgbatch_1",
        api="anthropic",
        owner="alice",
        endpoint="/v1/messages",
        state="in_progress",
        ended_reason=None,
        num_requests=5,
        created_at=T0,
        expires_at=T0 + DAY,
        cancel_initiated_at=None,
        ended_at=None,
        archived_at=None,
        input_file_id=None,
        output_file_id=None,
        error_file_id=None,
        metadata="{}",
        errors=None,
        idempotency_key=None,
    )
    assert store.get_batch("msgbatch_1", "alice") == created
    assert store.request_counts("msgbatch_1") == counts(queued=5)


def test_a_failure_midway_through_the_requests_stores_nothing(store: BatchStore) -> None:
    def failing() -> Iterator[NewRequest]:
        yield from new_requests(2500)  # two full insert chunks and part of a third
        raise RuntimeError("the upload broke")

    with pytest.raises(RuntimeError, match="the upload broke"):
        store.create_batch(new_batch("msgbatch_1"), failing())

    assert store.get_batch("msgbatch_1", "alice") is None
    assert num_request_rows(store) == 0
    # Nothing half-made blocks the id either.
    assert store.create_batch(new_batch("msgbatch_1"), new_requests(3)).num_requests == 3


def test_a_failed_validation_batch_is_stored_ended_without_requests(store: BatchStore) -> None:
    errors = '{"object": "list", "data": [{"code": "invalid_json", "line": 2}]}'
    failed = store.create_batch(new_batch("batch_1", api="openai", errors=errors), [])

    assert (failed.state, failed.ended_reason, failed.ended_at) == ("ended", "failed", T0)
    assert failed.errors == errors
    with pytest.raises(ValueError, match="no requests"):
        store.create_batch(new_batch("batch_2", api="openai", errors=errors), new_requests(1))
    assert store.get_batch("batch_2", "alice") is None


def test_the_same_idempotency_key_returns_the_first_batch(store: BatchStore) -> None:
    first = store.create_batch(new_batch("msgbatch_1", idempotency_key="k"), new_requests(3))

    def never_read() -> Iterator[NewRequest]:
        raise AssertionError("the requests of a repeated create are not read")
        yield

    again = store.create_batch(new_batch("msgbatch_2", idempotency_key="k"), never_read())
    other_owner = store.create_batch(
        new_batch("msgbatch_3", owner="bob", idempotency_key="k"), new_requests(2)
    )

    assert again == first
    assert store.get_batch("msgbatch_2", "alice") is None
    assert other_owner.id == "msgbatch_3"
    assert num_request_rows(store) == 5


def test_two_racing_creates_with_one_idempotency_key_make_one_batch(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenfleet.batch.store")
    inserting, second_writing = threading.Event(), threading.Event()
    created: dict[str, BatchRow] = {}

    def slow_requests() -> Iterator[NewRequest]:
        yield from new_requests(1500)
        inserting.set()
        # The first create holds its transaction open until the second is past its look-up
        # (which found nothing) and at its own write, where it waits for this one.
        assert second_writing.wait(60), "the second create never got to its write"
        yield from new_requests(10)

    stores = [BatchStore(url), BatchStore(url)]  # migrated here, not in the race

    @event.listens_for(stores[1].engine, "before_cursor_execute")
    def at_write(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        # The first statement the second store sends outside a read-only transaction (its
        # look-up is one): SQLite's BEGIN IMMEDIATE, PostgreSQL's INSERT of the batch.
        if not conn.get_execution_options().get("tokenfleet_read_only", False):
            second_writing.set()

    def first() -> None:
        batch = new_batch("msgbatch_1", idempotency_key="k")
        created["first"] = stores[0].create_batch(batch, slow_requests())

    def second() -> None:
        assert inserting.wait(60), "the first create never got to its requests"
        batch = new_batch("msgbatch_2", idempotency_key="k")
        created["second"] = stores[1].create_batch(batch, new_requests(7))

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert created["first"].id == created["second"].id == "msgbatch_1"
    # The second create got past its look-up and lost at the unique constraint.
    assert "batch msgbatch_2: idempotency key taken by msgbatch_1 meanwhile" in caplog.messages
    assert stores[1].get_batch("msgbatch_2", "alice") is None
    assert num_request_rows(stores[1]) == 1510
    for store in stores:
        store.close()


# --- reading -------------------------------------------------------------------------------


def test_list_batches_pages_newest_first_by_created_at_then_id(store: BatchStore) -> None:
    for i, created_at in enumerate([0, 1, 2, 2, 3]):
        store.create_batch(new_batch(f"b{i}", created_at=T0 + created_at), [])
    store.create_batch(new_batch("openai", api="openai", created_at=T0 + 9), [])
    store.create_batch(new_batch("bobs", owner="bob", created_at=T0 + 9), [])

    def page(**kwargs: Any) -> tuple[list[str], bool]:
        rows, has_more = store.list_batches("anthropic", "alice", 2, **kwargs)
        return [row.id for row in rows], has_more

    assert page() == (["b4", "b3"], True)
    assert page(after_id="b3") == (["b2", "b1"], True)
    assert page(after_id="b1") == (["b0"], False)
    assert page(before_id="b1") == (["b3", "b2"], True)
    assert page(before_id="b3") == (["b4"], False)
    assert store.list_batches("openai", "alice", 10) == (
        [store.get_batch("openai", "alice")],
        False,
    )
    with pytest.raises(InvalidRequestError) as unknown:
        page(after_id="bobs")
    assert unknown.value.param == "after_id"
    with pytest.raises(InvalidRequestError):
        page(after_id="b1", before_id="b3")


def test_another_owner_sees_nothing_and_changes_nothing(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(2))

    assert store.get_batch("msgbatch_1", "bob") is None
    assert store.get_batch_any_owner("msgbatch_1") == store.get_batch("msgbatch_1", "alice")
    assert store.cancel_batch("msgbatch_1", "bob", T0 + 1) is None
    assert store.delete_batch("msgbatch_1", "bob") is False
    assert store.list_batches("anthropic", "bob", 10) == ([], False)
    batch = store.get_batch("msgbatch_1", "alice")
    assert batch is not None and batch.state == "in_progress"
    assert store.request_counts("msgbatch_1") == counts(queued=2)


def test_request_counts_count_each_status(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(6))
    leased = store.lease("engine-a", 4, 60, T0)
    store.complete("msgbatch_1", leased[0].idx, leased[0].epoch, "succeeded", "{}", T0 + 1)
    store.complete("msgbatch_1", leased[1].idx, leased[1].epoch, "errored", "{}", T0 + 1)
    store.cancel_batch("msgbatch_1", "alice", T0 + 2)

    assert store.request_counts("msgbatch_1") == counts(
        succeeded=1, errored=1, leased=2, canceled=2
    )
    assert store.request_counts("no-such-batch") == counts()


def test_iter_results_streams_in_idx_order_one_chunk_per_query(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(2500))
    for leased in store.lease("engine-a", 2, 60, T0):
        store.complete("msgbatch_1", leased.idx, leased.epoch, "succeeded", '{"ok": 1}', T0)
    queries: list[str] = []

    @event.listens_for(store.engine, "before_cursor_execute")
    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().startswith("SELECT"):
            queries.append(statement)

    results = store.iter_results("msgbatch_1", chunk=1000)
    first = next(results)
    assert (first.idx, first.custom_id, first.status, first.result) == (
        0,
        "req-0",
        "succeeded",
        '{"ok": 1}',
    )
    assert len(queries) == 1
    rest = [next(results) for _ in range(999)]
    assert len(queries) == 1  # the first 1,000 came from one query
    assert next(results).idx == 1000
    assert len(queries) == 2
    rest += list(results)
    assert len(queries) == 3
    assert [row.idx for row in rest] == list(range(1, 1000)) + list(range(1001, 2500))
    assert rest[0].status == "succeeded" and rest[1].status == "queued"
    assert rest[1].result is None


# --- leases --------------------------------------------------------------------------------


def test_leases_go_earliest_deadline_first_then_grouped_by_prefix(store: BatchStore) -> None:
    store.create_batch(
        new_batch("late", created_at=T0, expires_at=T0 + 200), new_requests(2, ["a", "a"])
    )
    store.create_batch(
        new_batch("soon_new", created_at=T0 + 20, expires_at=T0 + 100, api="openai"),
        new_requests(1, ["x"]),
    )
    store.create_batch(
        new_batch("soon_old", created_at=T0 + 10, expires_at=T0 + 100),
        new_requests(5, ["p2", "p1", "p2", "p1", "p3"]),
    )

    first = store.lease("engine-a", 3, 60, T0 + 30)
    rest = store.lease("engine-b", 100, 60, T0 + 30)

    assert [(r.batch_id, r.idx) for r in first] == [
        ("soon_old", 1),
        ("soon_old", 3),
        ("soon_old", 0),
    ]
    assert [(r.batch_id, r.idx) for r in rest] == [
        ("soon_old", 2),
        ("soon_old", 4),
        ("soon_new", 0),
        ("late", 0),
        ("late", 1),
    ]
    assert rest[2].custom_id == "req-0"
    assert json.loads(rest[2].params) == {"max_tokens": 8, "i": 0}
    assert (rest[2].epoch, rest[2].attempts) == (1, 1)
    assert (rest[2].endpoint, rest[2].api) == ("/v1/chat/completions", "openai")
    assert store.lease("engine-c", 100, 60, T0 + 30) == []


def test_requests_of_a_batch_past_its_deadline_are_not_leased(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1", expires_at=T0 + 10), new_requests(2))

    assert store.lease("engine-a", 10, 60, T0 + 10) == []
    assert [r.idx for r in store.lease("engine-a", 10, 60, T0 + 9)] == [0, 1]


def test_a_late_result_under_an_old_epoch_is_refused(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(1))
    [old] = store.lease("engine-a", 1, 60, T0)
    assert store.requeue_owner("engine-a", T0 + 1) == 1
    [new] = store.lease("engine-b", 1, 60, T0 + 2)

    assert (old.epoch, new.epoch, new.attempts) == (1, 2, 2)
    assert store.complete("msgbatch_1", 0, old.epoch, "succeeded", '"late"', T0 + 3) is False
    assert store.complete("msgbatch_1", 0, new.epoch, "succeeded", '"fresh"', T0 + 3) is True
    assert store.complete("msgbatch_1", 0, new.epoch, "errored", '"twice"', T0 + 4) is False
    [result] = store.iter_results("msgbatch_1")
    assert (result.status, result.result) == ("succeeded", '"fresh"')


def test_complete_many_records_current_leases_and_refuses_stale_ones(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(3))
    a, b, c = store.lease("engine-a", 3, 60, T0)
    assert store.requeue_owner("engine-a", T0 + 1) == 3
    [b2] = [x for x in store.lease("engine-b", 3, 60, T0 + 2) if x.idx == b.idx]
    outcomes = [
        Outcome("msgbatch_1", a.idx, a.epoch, "succeeded", '"stale a"'),  # requeued since
        Outcome("msgbatch_1", b.idx, b2.epoch, "succeeded", '"b"'),
        Outcome("msgbatch_1", c.idx, c.epoch + 1, "errored", '"c"'),  # c's new lease
    ]

    assert store.complete_many(outcomes, T0 + 3) == 2
    assert store.complete_many([], T0 + 3) == 0
    assert [(r.idx, r.status, r.result) for r in store.iter_results("msgbatch_1")] == [
        (0, "leased", None),
        (1, "succeeded", '"b"'),
        (2, "errored", '"c"'),
    ]


def test_requeue_owner_returns_only_that_owners_leases(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(4))
    store.lease("engine-a", 3, 60, T0)
    [kept] = store.lease("engine-b", 1, 60, T0)

    assert store.requeue_owner("engine-a", T0 + 1) == 3
    assert store.request_counts("msgbatch_1") == counts(queued=3, leased=1)
    assert store.complete("msgbatch_1", kept.idx, kept.epoch, "succeeded", "{}", T0 + 2)


def test_expired_leases_come_back_queued(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(3))
    store.lease("engine-a", 2, 60, T0)

    assert store.requeue_expired_leases(T0 + 59.9) == 0
    assert store.requeue_expired_leases(T0 + 60) == 2
    assert store.request_counts("msgbatch_1") == counts(queued=3)
    again = store.lease("engine-b", 3, 60, T0 + 61)
    assert [(r.idx, r.epoch) for r in again] == [(0, 2), (1, 2), (2, 1)]


def test_renewed_leases_outlive_their_first_expiry(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(2))
    [kept] = store.lease("gateway-a", 1, 60, T0)
    store.lease("gateway-b", 1, 60, T0)

    assert store.renew_leases("gateway-a", 60, T0 + 50) == 1
    assert store.requeue_expired_leases(T0 + 60) == 1  # gateway-b's, not renewed
    assert store.requeue_expired_leases(T0 + 109) == 0
    assert store.complete("msgbatch_1", kept.idx, kept.epoch, "succeeded", "{}", T0 + 109)
    assert store.request_counts("msgbatch_1") == counts(succeeded=1, queued=1)


def test_a_request_that_keeps_failing_ends_errored_after_max_attempts(
    store: BatchStore,
) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(1))
    error = '{"type": "api_error", "message": "engine failed 3 times"}'
    statuses = []
    for attempt in range(3):
        [leased] = store.lease("engine-a", 1, 60, T0 + attempt)
        statuses.append(store.release("msgbatch_1", 0, leased.epoch, T0 + attempt, error))

    assert statuses == ["queued", "queued", "errored"]
    assert store.lease("engine-a", 1, 60, T0 + 5) == []
    assert store.release("msgbatch_1", 0, 3, T0 + 5) is None  # no current lease
    [result] = store.iter_results("msgbatch_1")
    assert (result.status, result.result) == ("errored", error)


def test_expired_leases_past_max_attempts_end_errored(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(2))
    store.lease("engine-a", 2, 10, T0)

    assert store.requeue_expired_leases(T0 + 10, '{"e": 1}', max_attempts=1) == 2
    assert store.request_counts("msgbatch_1") == counts(errored=2)
    assert [r.result for r in store.iter_results("msgbatch_1")] == ['{"e": 1}', '{"e": 1}']


# --- cancel, expiry, ending ----------------------------------------------------------------


def test_cancel_cancels_queued_requests_and_lets_leased_ones_finish(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(5))
    first, second, third = store.lease("engine-a", 3, 60, T0)

    canceling = store.cancel_batch("msgbatch_1", "alice", T0 + 1)

    assert canceling is not None
    assert (canceling.state, canceling.cancel_initiated_at) == ("canceling", T0 + 1)
    assert store.request_counts("msgbatch_1") == counts(leased=3, canceled=2)
    assert store.lease("engine-a", 10, 60, T0 + 2) == []
    assert store.finish_batches(T0 + 2) == []
    assert store.complete("msgbatch_1", first.idx, first.epoch, "succeeded", "{}", T0 + 3)
    assert store.complete("msgbatch_1", second.idx, second.epoch, "canceled", None, T0 + 3)
    # An engine failure in a canceling batch does not queue the request again.
    assert store.release("msgbatch_1", third.idx, third.epoch, T0 + 3) == "canceled"
    assert store.request_counts("msgbatch_1") == counts(succeeded=1, canceled=4)
    assert store.finish_batches(T0 + 4) == ["msgbatch_1"]
    ended = store.get_batch("msgbatch_1", "alice")
    assert ended is not None
    assert (ended.state, ended.ended_reason, ended.ended_at) == ("ended", "canceled", T0 + 4)
    assert store.cancel_batch("msgbatch_1", "alice", T0 + 5) == ended


def test_open_batches_are_those_in_progress_or_canceling(store: BatchStore) -> None:
    assert store.has_open_batches() is False
    store.create_batch(new_batch("msgbatch_1"), new_requests(1))
    store.create_batch(new_batch("msgbatch_2"), new_requests(1))
    assert store.has_open_batches() is True
    store.cancel_batch("msgbatch_1", "alice", T0 + 1)  # nothing leased: all canceled
    [leased] = store.lease("engine-a", 1, 60, T0 + 1)
    assert store.complete("msgbatch_2", leased.idx, leased.epoch, "succeeded", "{}", T0 + 2)
    assert store.has_open_batches() is True  # canceling, and in progress until ended
    assert sorted(store.finish_batches(T0 + 3)) == ["msgbatch_1", "msgbatch_2"]
    assert store.has_open_batches() is False
    store.create_batch(new_batch("batch_3", api="openai", errors='{"data": []}'), [])
    assert store.has_open_batches() is False  # failed validation: stored ended


def test_expiry_ends_queued_and_leased_requests(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1", expires_at=T0 + 100), new_requests(3))
    store.create_batch(new_batch("msgbatch_2", expires_at=T0 + 500), new_requests(1))
    [leased] = store.lease("engine-a", 1, 60, T0)

    assert store.expire_batches(T0 + 99) == []
    assert store.expire_batches(T0 + 100) == ["msgbatch_1"]
    assert store.request_counts("msgbatch_1") == counts(expired=3)
    assert store.request_counts("msgbatch_2") == counts(queued=1)
    assert store.complete("msgbatch_1", 0, leased.epoch, "succeeded", "{}", T0 + 101) is False
    assert store.expire_batches(T0 + 101) == []
    assert store.finish_batches(T0 + 102) == ["msgbatch_1"]
    ended = store.get_batch("msgbatch_1", "alice")
    assert ended is not None
    assert (ended.state, ended.ended_reason, ended.ended_at) == ("ended", "expired", T0 + 102)


def test_finish_ends_batches_with_nothing_left_to_run(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(2))
    store.create_batch(new_batch("msgbatch_2", created_at=T0 + 1), new_requests(1))
    store.create_batch(new_batch("msgbatch_3", created_at=T0 + 2), [])
    first, second = store.lease("engine-a", 2, 60, T0)
    store.complete("msgbatch_1", first.idx, first.epoch, "succeeded", "{}", T0 + 1)

    assert store.finish_batches(T0 + 2) == ["msgbatch_3"]
    store.complete("msgbatch_1", second.idx, second.epoch, "errored", "{}", T0 + 3)
    assert store.finish_batches(T0 + 4) == ["msgbatch_1"]
    assert store.finish_batches(T0 + 5) == []
    ended = store.get_batch("msgbatch_1", "alice")
    assert ended is not None
    assert (ended.state, ended.ended_reason, ended.ended_at) == ("ended", "completed", T0 + 4)
    store.set_result_files("msgbatch_1", "file-out", None)
    ended = store.get_batch("msgbatch_1", "alice")
    assert ended is not None and (ended.output_file_id, ended.error_file_id) == ("file-out", None)


def test_archive_drops_results_29_days_after_creation(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(2))
    never_ends = new_batch("msgbatch_2", expires_at=T0 + 40 * DAY)
    store.create_batch(never_ends, new_requests(1))
    for leased in store.lease("engine-a", 10, 60, T0)[:2]:
        store.complete("msgbatch_1", leased.idx, leased.epoch, "succeeded", "{}", T0 + 1)
    store.expire_batches(T0 + DAY)
    store.finish_batches(T0 + DAY)

    assert store.archive_batches(T0 + 29 * DAY - 1) == []
    assert store.archive_batches(T0 + 29 * DAY) == ["msgbatch_1"]
    assert store.archive_batches(T0 + 30 * DAY) == []
    archived = store.get_batch("msgbatch_1", "alice")
    assert archived is not None and archived.archived_at == T0 + 29 * DAY
    assert list(store.iter_results("msgbatch_1")) == []
    assert store.request_counts("msgbatch_1") == counts(succeeded=2)
    assert num_request_rows(store) == 1


def test_only_an_ended_batch_can_be_deleted(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), new_requests(2))

    with pytest.raises(BatchNotEnded):
        store.delete_batch("msgbatch_1", "alice")
    store.cancel_batch("msgbatch_1", "alice", T0 + 1)
    with pytest.raises(BatchNotEnded):
        store.delete_batch("msgbatch_1", "alice")
    store.finish_batches(T0 + 2)
    assert store.delete_batch("msgbatch_1", "alice") is True
    assert store.get_batch("msgbatch_1", "alice") is None
    assert num_request_rows(store) == 0
    assert store.delete_batch("msgbatch_1", "alice") is False


# --- files ---------------------------------------------------------------------------------


def test_files_are_per_owner_and_page_newest_first(store: BatchStore) -> None:
    def file(file_id: str, created_at: float, purpose: str = "batch", owner: str = "a") -> FileRow:
        return FileRow(file_id, owner, purpose, f"{file_id}.jsonl", 10, created_at, "processed", "")

    for row in [
        file("file-1", T0),
        file("file-2", T0 + 1),
        file("file-3", T0 + 1),
        file("file-4", T0 + 2, purpose="batch_output"),
        file("file-5", T0 + 3, owner="b"),
    ]:
        store.create_file(row)

    def page(**kwargs: Any) -> tuple[list[str], bool]:
        rows, has_more = store.list_files("a", **kwargs)
        return [row.id for row in rows], has_more

    assert store.get_file("file-1", "a") == file("file-1", T0)
    assert store.get_file("file-1", "b") is None
    assert page() == (["file-4", "file-3", "file-2", "file-1"], False)
    assert page(purpose="batch", limit=2) == (["file-3", "file-2"], True)
    assert page(purpose="batch", limit=2, after="file-2") == (["file-1"], False)
    assert store.delete_file("file-1", "b") is False
    assert store.delete_file("file-1", "a") is True
    assert store.get_file("file-1", "a") is None
    with pytest.raises(InvalidRequestError):
        page(after="file-1")


# --- schema --------------------------------------------------------------------------------


def test_migrate_is_idempotent_and_keeps_the_data(url: str) -> None:
    with BatchStore(url) as store:
        store.create_batch(new_batch("msgbatch_1"), new_requests(1))
        assert store.migrate() == SCHEMA_VERSION
    with BatchStore(url) as store:
        assert store.request_counts("msgbatch_1") == counts(queued=1)
        with store.engine.connect() as conn:
            versions = conn.execute(select(schema_version.c.version)).scalars().all()
    assert versions == list(range(1, SCHEMA_VERSION + 1))


def test_concurrent_migrations_apply_each_version_once(url: str) -> None:
    stores = [BatchStore(url, migrate=False) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    versions: list[int] = []

    def migrate(store: BatchStore) -> None:
        barrier.wait(10)
        versions.append(store.migrate())

    threads = [threading.Thread(target=migrate, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert versions == [SCHEMA_VERSION] * 4
    with stores[0].engine.connect() as conn:
        rows = conn.execute(select(schema_version.c.version)).scalars().all()
    assert rows == list(range(1, SCHEMA_VERSION + 1))
    assert stores[0].create_batch(new_batch("msgbatch_1"), new_requests(1)).num_requests == 1
    for store in stores:
        store.close()


def test_a_database_from_a_newer_tokenfleet_is_refused(store: BatchStore) -> None:
    with store.engine.begin() as conn:
        conn.execute(insert(schema_version).values(version=SCHEMA_VERSION + 1))

    with pytest.raises(SchemaTooNew):
        store.migrate()


def test_plain_postgresql_urls_use_psycopg_3() -> None:
    assert engine_url("postgresql://u:p@h:5/db").drivername == "postgresql+psycopg"
    assert engine_url("postgres://u:p@h:5/db").drivername == "postgresql+psycopg"
    assert engine_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"
    assert engine_url("sqlite:///x.db").drivername == "sqlite"


# --- concurrency and scale -----------------------------------------------------------------


def _lease_until_empty(
    url: str, owner: str, start: Any, results: Any
) -> None:  # runs in a spawned process
    leased: list[int] = []
    refused = 0
    with BatchStore(url, migrate=False) as store:
        start.wait(60)
        while batch := store.lease(owner, 25, 300, T0):
            for request in batch:
                leased.append(request.idx)
                if not store.complete(
                    request.batch_id, request.idx, request.epoch, "succeeded", "{}", T0
                ):
                    refused += 1
    results.put((owner, leased, refused))


def test_processes_sharing_one_database_lease_each_request_exactly_once(url: str) -> None:
    with BatchStore(url) as store:
        store.create_batch(
            new_batch("msgbatch_1"), new_requests(2000, (str(i % 7) for i in range(2000)))
        )
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(4), context.Queue()
    workers = [
        context.Process(target=_lease_until_empty, args=(url, f"gateway-{i}", start, results))
        for i in range(4)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(30)

    leased = sorted(idx for _, idxs, _ in outcomes for idx in idxs)
    assert leased == list(range(2000))
    assert [refused for _, _, refused in outcomes] == [0, 0, 0, 0]
    assert sum(1 for _, idxs, _ in outcomes if idxs) >= 2  # they really did share the work
    with BatchStore(url) as store:
        assert store.request_counts("msgbatch_1") == counts(succeeded=2000)


def test_a_100k_request_batch_is_created_and_streamed_back_on_sqlite(tmp_path: Any) -> None:
    with BatchStore(f"sqlite:///{tmp_path / 'batches.db'}") as store:
        created = store.create_batch(new_batch("msgbatch_1"), new_requests(100_000))

        assert created.num_requests == 100_000
        assert store.request_counts("msgbatch_1") == counts(queued=100_000)
        num_results = 0
        for expected_idx, row in enumerate(store.iter_results("msgbatch_1")):
            assert row.idx == expected_idx
            num_results += 1
        assert num_results == 100_000
