"""Attempts, the store's clock, durability, quotas and fair shares of the batch store, on a
real SQLite file and a real PostgreSQL: every test runs on both (SQLite-only ones say so).

Attempts count only failures of the request itself (an ending with an error); a gateway
that stops (requeue_owner) or a lease that expires gives the request back without using
one up. Lease expiry is set and judged by the database's clock when asked to."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, insert, select, text

from tokenfleet.batch import (
    SCHEMA_VERSION,
    BatchStore,
    NewBatch,
    NewRequest,
    QuotaExceeded,
    engine_url,
)
from tokenfleet.batch.schema import MIGRATIONS, FileRow, batch_requests, schema_version

T0 = 1_750_000_000.0
DAY = 24 * 3600.0
ERROR = '{"type": "errored", "error": {"type": "api_error", "message": "died 3 times"}}'


def new_batch(
    batch_id: str, owner: str = "alice", created_at: float = T0, expires_at: float | None = None
) -> NewBatch:
    return NewBatch(
        id=batch_id,
        api="anthropic",
        owner=owner,
        endpoint="/v1/messages",
        created_at=created_at,
        expires_at=created_at + DAY if expires_at is None else expires_at,
    )


def requests(num: int) -> Iterator[NewRequest]:
    for i in range(num):
        yield NewRequest(f"req-{i}", json.dumps({"i": i}))


def row(store: BatchStore, batch_id: str, idx: int = 0) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(
            select(batch_requests).where(
                batch_requests.c.batch_id == batch_id, batch_requests.c.idx == idx
            )
        ).one()


# --- attempts --------------------------------------------------------------------------------


def test_gateway_stops_and_expired_leases_use_up_no_attempt(store: BatchStore) -> None:
    """The bug this replaces: three requeues ended the request errored with a null result."""
    store.create_batch(new_batch("msgbatch_1"), requests(1))
    for i in range(5):  # stopped gateways, then expired leases, 10 times in all
        [leased] = store.lease("gateway-a", 1, 60, T0 + 2 * i)
        assert store.requeue_owner("gateway-a", T0 + 2 * i + 1, None, 3) == 1
        [leased] = store.lease("gateway-b", 1, 60, T0 + 2 * i + 1)
        assert store.requeue_expired_leases(T0 + 2 * i + 61, None, 3) == 1
    assert (row(store, "msgbatch_1").status, row(store, "msgbatch_1").failures) == ("queued", 0)
    [leased] = store.lease("gateway-a", 1, 60, T0 + 100)
    assert leased.attempts == 11  # leased 11 times, failed none
    assert store.complete("msgbatch_1", 0, leased.epoch, "succeeded", '"ok"', T0 + 101)
    [result] = store.iter_results("msgbatch_1")
    assert (result.status, result.result) == ("succeeded", '"ok"')


def test_only_failures_with_an_error_count_and_the_last_one_is_the_result(
    store: BatchStore,
) -> None:
    store.create_batch(new_batch("msgbatch_1"), requests(1))
    statuses = []
    for attempt in range(3):
        # A stop in between counts nothing.
        [leased] = store.lease("gateway-a", 1, 60, T0 + attempt)
        assert store.release("msgbatch_1", 0, leased.epoch, T0 + attempt) == "queued"
        [leased] = store.lease("gateway-a", 1, 60, T0 + attempt)
        statuses.append(store.release("msgbatch_1", 0, leased.epoch, T0 + attempt, ERROR, 3))

    assert statuses == ["queued", "queued", "errored"]
    final = row(store, "msgbatch_1")
    assert (final.status, final.failures, final.attempts) == ("errored", 3, 6)
    [result] = store.iter_results("msgbatch_1")
    assert result.result == ERROR  # an error object, never null


def test_no_uncounted_ending_leaves_an_errored_request_without_an_error(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), requests(3))
    for i in range(4):
        store.lease("gateway-a", 3, 10, T0 + 20 * i)
        store.requeue_expired_leases(T0 + 20 * i + 10, None, 1)  # even at max_attempts 1
    assert {r.status for r in store.iter_results("msgbatch_1")} == {"queued"}


# --- the store's clock ----------------------------------------------------------------------


def test_lease_expiry_is_set_and_judged_by_the_database_clock(store: BatchStore) -> None:
    """A gateway whose clock runs a day ahead (or behind) neither takes a live lease nor
    keeps a dead one: with store_clock the given `now` plays no part in expiry."""
    now = time.time()
    store.create_batch(new_batch("msgbatch_1", created_at=now), requests(2))
    [first] = store.lease("gateway-a", 1, 60, now, True)
    expires = row(store, "msgbatch_1", first.idx).lease_expires_at
    assert abs(expires - (time.time() + 60)) < 5  # the database's clock is the real one

    assert store.requeue_expired_leases(now + DAY, None, 3, True) == 0  # ahead: kept
    [second] = store.lease("gateway-b", 1, 0.2, now, True)
    time.sleep(0.3)
    assert store.requeue_expired_leases(now - DAY, None, 3, True) == 1  # behind: still ends
    assert row(store, "msgbatch_1", second.idx).status == "queued"

    assert store.renew_leases("gateway-a", 0.2, now + DAY, True) == 1
    time.sleep(0.3)
    assert store.requeue_expired_leases(now + DAY, None, 3, True) == 1
    assert row(store, "msgbatch_1", first.idx).failures == 0


# --- durability ------------------------------------------------------------------------------


def test_sqlite_commits_with_synchronous_full_in_wal(tmp_path: Any) -> None:
    """SQLite only: every connection of the store syncs each commit to disk."""
    with BatchStore(f"sqlite:///{tmp_path / 'batches.db'}") as store, store.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_a_version_1_database_migrates_with_no_failures_counted(url: str) -> None:
    engine = create_engine(engine_url(url))
    with engine.begin() as conn:
        schema_version.create(conn)
        MIGRATIONS[0](conn)
        conn.execute(insert(schema_version).values(version=1))
        conn.execute(
            text(
                "INSERT INTO batches (id, api, owner, endpoint, state, num_requests, created_at,"
                " expires_at, metadata) VALUES ('msgbatch_1', 'anthropic', 'alice',"
                " '/v1/messages', 'in_progress', 1, :t, :e, '{}')"
            ),
            {"t": T0, "e": T0 + DAY},
        )
        conn.execute(
            text(
                "INSERT INTO batch_requests (batch_id, idx, custom_id, params, prefix_key, status,"
                " deadline, submitted_at, attempts, lease_epoch) VALUES ('msgbatch_1', 0, 'r',"
                " '{}', '', 'queued', :e, :t, 2, 2)"
            ),
            {"t": T0, "e": T0 + DAY},
        )
    engine.dispose()
    with BatchStore(url) as store:
        assert SCHEMA_VERSION == 3
        assert row(store, "msgbatch_1").failures == 0
        [leased] = store.lease("gateway-a", 1, 60, T0)
        assert (leased.attempts, leased.epoch) == (3, 3)


# --- quotas ---------------------------------------------------------------------------------


def test_a_create_over_the_owners_queued_quota_stores_nothing(store: BatchStore) -> None:
    store.create_batch(new_batch("msgbatch_1"), requests(6), 10)
    store.create_batch(new_batch("msgbatch_2", owner="bob"), requests(10), 10)  # bob's own
    with pytest.raises(QuotaExceeded) as refused:
        store.create_batch(new_batch("msgbatch_3"), requests(5), 10)
    assert (refused.value.queued, refused.value.quota) == (6, 10)
    assert "over your quota of 10" in str(refused.value)
    assert store.get_batch("msgbatch_3", "alice") is None
    assert store.queued_requests("alice") == 6

    # Leased requests still wait to run; finished ones no longer count.
    for leased in store.lease("gateway-a", 2, 60, T0):
        if leased.batch_id == "msgbatch_1":
            store.complete(leased.batch_id, leased.idx, leased.epoch, "succeeded", "{}", T0)
    assert store.create_batch(new_batch("msgbatch_3"), requests(5), 10).num_requests == 5
    assert store.queued_requests("alice") == 10


def test_a_key_groups_owners_share_one_queued_quota(store: BatchStore) -> None:
    group = ("alice", "carol")
    store.create_batch(new_batch("msgbatch_1"), requests(6), 10, group)
    store.create_batch(new_batch("msgbatch_2", owner="bob"), requests(10), 10)  # another group
    with pytest.raises(QuotaExceeded) as refused:
        store.create_batch(new_batch("msgbatch_3", owner="carol"), requests(5), 10, group)
    assert (refused.value.queued, refused.value.quota) == (6, 10)
    assert store.get_batch("msgbatch_3", "carol") is None
    assert store.create_batch(new_batch("msgbatch_3", owner="carol"), requests(4), 10, group)
    assert store.queued_requests("alice") + store.queued_requests("carol") == 10


def test_a_file_over_the_stored_bytes_quota_is_not_recorded(store: BatchStore) -> None:
    def file(file_id: str, owner: str, num_bytes: int) -> FileRow:
        return FileRow(file_id, owner, "batch", "in.jsonl", num_bytes, T0, "processed", "")

    group = ("alice", "carol")
    store.create_file(file("file-1", "alice", 600), 1000, group)
    store.create_file(file("file-2", "bob", 1000), 1000)  # bob's own quota
    with pytest.raises(QuotaExceeded) as refused:
        store.create_file(file("file-3", "carol", 401), 1000, group)
    assert (refused.value.queued, refused.value.quota) == (600, 1000)
    assert "over your quota of 1000" in str(refused.value)
    assert store.get_file("file-3", "carol") is None
    store.create_file(file("file-3", "carol", 400), 1000, group)  # exactly the quota
    assert store.delete_file("file-1", "alice")
    store.create_file(file("file-4", "alice", 600), 1000, group)  # room freed by the delete
    assert [f.id for f in store.list_files("carol")[0]] == ["file-3"]


# --- fair shares ----------------------------------------------------------------------------


def test_a_second_owner_gets_the_free_slots_before_the_first_takes_more(
    store: BatchStore,
) -> None:
    store.create_batch(new_batch("big", owner="a"), requests(100))
    held = store.lease("gateway", 8, 60, T0)
    assert {r.batch_id for r in held} == {"big"} and len(held) == 8
    # b's batch comes later and expires later: deadline order alone would give it nothing.
    store.create_batch(new_batch("small", owner="b", created_at=T0 + 1), requests(3))
    for leased in held[:2]:
        store.complete("big", leased.idx, leased.epoch, "succeeded", "{}", T0 + 2)

    freed = store.lease("gateway", 2, 60, T0 + 2)
    assert [(r.batch_id, r.idx) for r in freed] == [("small", 0), ("small", 1)]
    # b holds 2 and a 6: the next slots go to b until b has no more queued, then to a.
    more = store.lease("gateway", 4, 60, T0 + 2)
    assert [(r.batch_id, r.idx) for r in more] == [
        ("big", 8),
        ("big", 9),
        ("big", 10),
        ("small", 2),
    ]


def test_owners_share_one_lease_evenly_in_deadline_order_within_each(store: BatchStore) -> None:
    store.create_batch(new_batch("a1", owner="a", expires_at=T0 + 100), requests(10))
    store.create_batch(new_batch("a2", owner="a", expires_at=T0 + 50), requests(2))
    store.create_batch(new_batch("b1", owner="b", expires_at=T0 + 900), requests(10))
    store.create_batch(new_batch("c1", owner="c", expires_at=T0 + 900), requests(1))

    leased = store.lease("gateway", 9, 60, T0)
    by_batch: dict[str, list[int]] = {}
    for r in leased:
        by_batch.setdefault(r.batch_id, []).append(r.idx)
    # c has only 1: its share's rest goes to a and b, 4 each; a's earliest deadline first.
    assert by_batch == {"a2": [0, 1], "a1": [0, 1], "b1": [0, 1, 2, 3], "c1": [0]}
    assert [r.batch_id for r in leased][:2] == ["a2", "a2"]  # returned in deadline order
    rest = store.lease("gateway", 100, 60, T0)
    assert len(rest) == 23 - 9
    assert len({(r.batch_id, r.idx) for r in leased + rest}) == 23  # each exactly once
