"""Batches as callers see them: create, get, list, count, cancel, delete, read results.

Each method is one transaction. Creating a batch inserts its requests in the same
transaction, so a batch is stored with all of its requests or not at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from tokenfleet.batch.database import (
    BatchStoreError,
    QuotaExceeded,
    StoreBase,
    keyset,
    logger,
)
from tokenfleet.batch.schema import (
    REQUEST_STATUSES,
    Api,
    BatchRow,
    NewBatch,
    NewRequest,
    RequestStatus,
    ResultRow,
    batch_requests,
    batches,
)
from tokenfleet.errors import InvalidRequestError

INSERT_CHUNK = 1000
ANALYZE_AFTER_ROWS = 10_000

_b = batches.c
_r = batch_requests.c
_BATCH_COLUMNS = [batches.c[f.name] for f in fields(BatchRow)]


class BatchNotEnded(BatchStoreError):
    """Only an ended batch can be deleted (maps to HTTP 400)."""


class BatchesMixin(StoreBase):
    """The batch methods of BatchStore."""

    def create_batch(
        self,
        batch: NewBatch,
        requests: Iterable[NewRequest],
        max_queued: int | None = None,
        quota_owners: Sequence[str] = (),
    ) -> BatchRow:
        """Stores the batch and its requests, all or nothing, in one transaction.

        Requests are numbered in order and inserted `INSERT_CHUNK` at a time, so the
        iterable is never held whole. If this owner already created a batch with the same
        idempotency key, that batch comes back and nothing is inserted. `max_queued`: the
        quota of requests not yet run (queued or leased, this batch's included) of the
        owner, or of `quota_owners` together (a key group); over it, nothing is stored and
        QuotaExceeded is raised.
        """
        if batch.idempotency_key is not None:
            existing = self._get_by_idempotency_key(batch.owner, batch.idempotency_key)
            if existing is not None:
                return existing
        try:
            with self.engine.begin() as conn:
                num_requests = _insert_batch(conn, batch, requests)
                if max_queued is not None and num_requests:
                    # Counted after the insert, in its transaction: racing creates of one
                    # owner cannot both slip under the quota (SQLite has one writer;
                    # PostgreSQL may let two through at worst, by one batch each).
                    queued = self._queued_of(conn, quota_owners or (batch.owner,))
                    if queued > max_queued:
                        raise QuotaExceeded(
                            f"this batch would bring your requests waiting to run to "
                            f"{queued}, over your quota of {max_queued}; wait for your "
                            "batches to finish, or cancel one",
                            queued=queued - num_requests,
                            quota=max_queued,
                        )
        except IntegrityError:
            # A racing create with the same key committed first.
            if batch.idempotency_key is None:
                raise
            existing = self._get_by_idempotency_key(batch.owner, batch.idempotency_key)
            if existing is None:
                raise
            logger.info("batch %s: idempotency key taken by %s meanwhile", batch.id, existing.id)
            return existing
        if not self.is_sqlite and num_requests >= ANALYZE_AFTER_ROWS:
            # Fresh statistics, or PostgreSQL plans the next leases as a sort of every
            # queued row (hundreds of ms each) until autovacuum gets to the table.
            with self.engine.begin() as conn:
                conn.execute(text("ANALYZE batch_requests"))
        created = self.get_batch(batch.id, batch.owner)
        assert created is not None
        return created

    def queued_requests(self, owner: str) -> int:
        """How many of this owner's requests are waiting to run (queued or leased)."""
        with self._reader.begin() as conn:
            return self._queued_of(conn, (owner,))

    @staticmethod
    def _queued_of(conn: Connection, owners: Sequence[str]) -> int:
        open_ids = select(_b.id).where(_b.owner.in_(owners), _b.state == "in_progress")
        return int(
            conn.execute(
                select(func.count()).where(
                    _r.batch_id.in_(open_ids), _r.status.in_(("queued", "leased"))
                )
            ).scalar_one()
        )

    def _get_by_idempotency_key(self, owner: str, key: str) -> BatchRow | None:
        with self._reader.begin() as conn:
            row = conn.execute(
                select(*_BATCH_COLUMNS).where(_b.owner == owner, _b.idempotency_key == key)
            ).first()
        return None if row is None else BatchRow(*row)

    def get_batch(self, batch_id: str, owner: str) -> BatchRow | None:
        """The batch, or None when there is none or it is another owner's."""
        with self._reader.begin() as conn:
            return _batch(conn, batch_id, owner)

    def get_batch_any_owner(self, batch_id: str) -> BatchRow | None:
        """The batch whoever owns it: for the gateway's own bookkeeping, never a caller's."""
        with self._reader.begin() as conn:
            row = conn.execute(select(*_BATCH_COLUMNS).where(_b.id == batch_id)).first()
        return None if row is None else BatchRow(*row)

    def list_batches(
        self,
        api: Api,
        owner: str,
        limit: int,
        after_id: str | None = None,
        before_id: str | None = None,
    ) -> tuple[list[BatchRow], bool]:
        """One page of this owner's batches of `api`, newest first, and whether more follow.

        `after_id`: the page of older batches right after that one (OpenAI's `after`);
        `before_id`: the page of newer batches right before it. Order: created_at, then id.
        """
        if after_id is not None and before_id is not None:
            raise InvalidRequestError("give after_id or before_id, not both", param="before_id")
        key = (_b.created_at, _b.id)
        query = select(*_BATCH_COLUMNS).where(_b.owner == owner, _b.api == api)
        with self._reader.begin() as conn:
            cursor_id = after_id if after_id is not None else before_id
            if cursor_id is not None:
                cursor = _batch(conn, cursor_id, owner)
                if cursor is None or cursor.api != api:
                    param = "after_id" if after_id is not None else "before_id"
                    raise InvalidRequestError(f"no batch {cursor_id!r} to page from", param=param)
                after = after_id is not None
                query = query.where(keyset(key, (cursor.created_at, cursor.id), older=after))
            newest_first = before_id is None
            order = [c.desc() for c in key] if newest_first else [c.asc() for c in key]
            rows = conn.execute(query.order_by(*order).limit(limit + 1)).all()
        page = [BatchRow(*row) for row in rows[:limit]]
        if not newest_first:
            page.reverse()
        return page, len(rows) > limit

    def request_counts(self, batch_id: str) -> dict[RequestStatus, int]:
        """How many requests of the batch are in each status (every status present)."""
        counts = dict.fromkeys(REQUEST_STATUSES, 0)
        with self._reader.begin() as conn:
            archived = conn.execute(
                select(_b.archived_counts).where(_b.id == batch_id)
            ).scalar_one_or_none()
            if archived is not None:
                counts.update(json.loads(archived))
                return counts
            counts.update(status_counts(conn, batch_id))
        return counts

    def set_result_files(
        self, batch_id: str, output_file_id: str | None, error_file_id: str | None
    ) -> None:
        """Records the output and error files the gateway built for an ended batch."""
        with self.engine.begin() as conn:
            conn.execute(
                update(batches)
                .where(_b.id == batch_id)
                .values(output_file_id=output_file_id, error_file_id=error_file_id)
            )

    def cancel_batch(self, batch_id: str, owner: str, now: float) -> BatchRow | None:
        """Cancels the batch's queued requests and marks it canceling.

        Leased requests are left to finish: the gateway aborts them and completes them as
        canceled (or with whatever result they reached). Canceling a canceling or ended
        batch changes nothing. None when there is no such batch of this owner.
        """
        with self.engine.begin() as conn:
            started = conn.execute(
                update(batches)
                .where(_b.id == batch_id, _b.owner == owner, _b.state == "in_progress")
                .values(state="canceling", cancel_initiated_at=now)
            ).rowcount
            if started:
                conn.execute(
                    update(batch_requests)
                    .where(_r.batch_id == batch_id, _r.status == "queued")
                    .values(status="canceled", finished_at=now)
                )
                logger.info("batch %s canceling", batch_id)
            return _batch(conn, batch_id, owner)

    def delete_batch(self, batch_id: str, owner: str) -> bool:
        """Deletes an ended batch and its requests; False when there is no such batch.

        Raises BatchNotEnded for a batch still in progress or canceling.
        """
        with self.engine.begin() as conn:
            batch = _batch(conn, batch_id, owner)
            if batch is None:
                return False
            if batch.state != "ended":
                raise BatchNotEnded(f"batch {batch_id} is {batch.state}; cancel it first")
            conn.execute(delete(batch_requests).where(_r.batch_id == batch_id))
            conn.execute(delete(batches).where(_b.id == batch_id))
        return True

    def iter_results(self, batch_id: str, chunk: int = 1000) -> Iterator[ResultRow]:
        """The batch's requests in idx order, `chunk` rows per query (memory stays bounded).

        Each chunk is its own short read, so no transaction stays open while the caller
        streams the results out.
        """
        next_idx = 0
        while True:
            with self._reader.begin() as conn:
                rows = conn.execute(
                    select(_r.idx, _r.custom_id, _r.status, _r.result)
                    .where(_r.batch_id == batch_id, _r.idx >= next_idx)
                    .order_by(_r.idx)
                    .limit(chunk)
                ).all()
            for row in rows:
                yield ResultRow(*row)
            if len(rows) < chunk:
                return
            next_idx = rows[-1].idx + 1


def status_counts(conn: Connection, batch_id: str) -> dict[RequestStatus, int]:
    """How many of the batch's request rows are in each status (absent statuses left out)."""
    rows = conn.execute(
        select(_r.status, func.count()).where(_r.batch_id == batch_id).group_by(_r.status)
    ).all()
    return {status: num for status, num in rows}


def _insert_batch(conn: Connection, batch: NewBatch, requests: Iterable[NewRequest]) -> int:
    failed = batch.errors is not None
    conn.execute(
        insert(batches).values(
            id=batch.id,
            api=batch.api,
            owner=batch.owner,
            endpoint=batch.endpoint,
            state="ended" if failed else "in_progress",
            ended_reason="failed" if failed else None,
            ended_at=batch.created_at if failed else None,
            num_requests=0,
            created_at=batch.created_at,
            expires_at=batch.expires_at,
            input_file_id=batch.input_file_id,
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            metadata=batch.metadata,
            errors=batch.errors,
            idempotency_key=batch.idempotency_key,
        )
    )
    chunk: list[dict[str, Any]] = []
    num_requests = 0
    for idx, request in enumerate(requests):
        if failed:
            raise ValueError("a failed batch (errors set) has no requests")
        chunk.append(
            {
                "batch_id": batch.id,
                "idx": idx,
                "custom_id": request.custom_id,
                "params": request.params,
                "prefix_key": request.prefix_key,
                "status": "queued",
                "deadline": batch.expires_at,
                "submitted_at": batch.created_at,
                "attempts": 0,
                "lease_epoch": 0,
            }
        )
        num_requests += 1
        if len(chunk) == INSERT_CHUNK:
            conn.execute(insert(batch_requests), chunk)
            chunk = []
    if chunk:
        conn.execute(insert(batch_requests), chunk)
    conn.execute(update(batches).where(_b.id == batch.id).values(num_requests=num_requests))
    logger.info("created batch %s with %d requests", batch.id, num_requests)
    return num_requests


def _batch(conn: Connection, batch_id: str, owner: str) -> BatchRow | None:
    row = conn.execute(select(*_BATCH_COLUMNS).where(_b.id == batch_id, _b.owner == owner)).first()
    return None if row is None else BatchRow(*row)
