"""The durable batch store: batches, their requests and leases, and file metadata.

SQLAlchemy Core over SQLite (one gateway) or PostgreSQL (several gateways sharing one
database). Every method is one transaction and takes the current time as an argument.
On PostgreSQL a lease claims rows with `SELECT ... FOR UPDATE SKIP LOCKED`; on SQLite
every write transaction is `BEGIN IMMEDIATE` (one writer at a time, WAL for readers).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, fields
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Text,
    and_,
    bindparam,
    case,
    create_engine,
    delete,
    event,
    exists,
    func,
    insert,
    literal,
    null,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL, Engine, Row, make_url
from sqlalchemy.exc import IntegrityError

from tokenfleet.batch.schema import (
    MIGRATIONS,
    REQUEST_STATUSES,
    Api,
    BatchRow,
    FileRow,
    LeasedRequest,
    NewBatch,
    NewRequest,
    Outcome,
    RequestStatus,
    ResultRow,
    batch_requests,
    batches,
    files,
    schema_version,
)
from tokenfleet.errors import InvalidRequestError, TokenfleetError

logger = logging.getLogger(__name__)

INSERT_CHUNK = 1000
ANALYZE_AFTER_ROWS = 10_000
SQLITE_BUSY_TIMEOUT_MS = 30_000
ARCHIVE_AFTER_SECONDS = 29 * 24 * 3600
# pg_advisory_xact_lock key that serializes migrate() across processes ("tokenflt").
_MIGRATE_LOCK_KEY = 0x746F6B656E666C74
_ACTIVE: tuple[RequestStatus, ...] = ("queued", "leased")
_FINAL_BY_COMPLETE: tuple[RequestStatus, ...] = ("succeeded", "errored", "canceled")

_b = batches.c
_r = batch_requests.c
_BATCH_COLUMNS = [batches.c[f.name] for f in fields(BatchRow)]
_FILE_COLUMNS = [files.c[f.name] for f in fields(FileRow)]


class BatchStoreError(TokenfleetError):
    """Base of the batch store's own errors."""


class BatchNotEnded(BatchStoreError):
    """Only an ended batch can be deleted (maps to HTTP 400)."""


class SchemaTooNew(BatchStoreError):
    """The database was migrated by a newer tokenfleet than this one."""


def engine_url(url: str) -> URL:
    """`url` with plain `postgresql://` (or `postgres://`) mapped to the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


class BatchStore:
    """Batches, requests and files in one database; migrates it when opened.

    Thread-safe: each method checks a connection out of the engine's pool. Several
    stores (threads, processes, gateways) may share one database.
    """

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        self.url = engine_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        if self.is_sqlite:
            self.engine = create_engine(self.url)
            _configure_sqlite(self.engine)
        else:
            self.engine = create_engine(self.url, pool_pre_ping=True)
        # For reads: the same pool, but on SQLite its transactions begin deferred, so that
        # reads do not queue behind the one writer.
        self._reader = self.engine.execution_options(tokenfleet_read_only=True)
        if migrate:
            self.migrate()

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> BatchStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def migrate(self) -> int:
        """Applies the migrations this database lacks; returns the schema version.

        Idempotent, and safe from several processes at once: PostgreSQL serializes on an
        advisory lock, SQLite on its write lock; either way in one transaction.
        """
        with self.engine.begin() as conn:
            if not self.is_sqlite:
                conn.execute(select(func.pg_advisory_xact_lock(_MIGRATE_LOCK_KEY)))
            schema_version.create(conn, checkfirst=True)
            current = conn.execute(select(func.max(schema_version.c.version))).scalar() or 0
            if current > len(MIGRATIONS):
                raise SchemaTooNew(
                    f"database schema is version {current}; this tokenfleet knows {len(MIGRATIONS)}"
                )
            for version in range(current + 1, len(MIGRATIONS) + 1):
                MIGRATIONS[version - 1](conn)
                conn.execute(insert(schema_version).values(version=version))
                logger.info("batch store migrated to schema version %d", version)
        return len(MIGRATIONS)

    # --- batches -------------------------------------------------------------------------

    def create_batch(self, batch: NewBatch, requests: Iterable[NewRequest]) -> BatchRow:
        """Stores the batch and its requests, all or nothing, in one transaction.

        Requests are numbered in order and inserted `INSERT_CHUNK` at a time, so the
        iterable is never held whole. If this owner already created a batch with the same
        idempotency key, that batch comes back and nothing is inserted.
        """
        if batch.idempotency_key is not None:
            existing = self._get_by_idempotency_key(batch.owner, batch.idempotency_key)
            if existing is not None:
                return existing
        try:
            with self.engine.begin() as conn:
                num_requests = _insert_batch(conn, batch, requests)
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

    def has_open_batches(self) -> bool:
        """Whether any batch is in progress or being canceled. Only those have queued or
        leased requests, so with none the dispatcher has nothing to lease, expire, end or
        requeue: one read instead of its round of writes."""
        open_batch = exists().where(_b.state.in_(("in_progress", "canceling")))
        with self._reader.begin() as conn:
            return bool(conn.execute(select(open_batch)).scalar())

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
                query = query.where(_keyset(key, (cursor.created_at, cursor.id), older=after))
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
            counts.update(_counts(conn, batch_id))
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

    def expire_batches(self, now: float) -> list[str]:
        """Queued and leased requests of batches past expires_at become expired.

        Returns the ids of the batches that had any; finish_batches() then ends them.
        """
        touched = []
        with self.engine.begin() as conn:
            due = conn.execute(
                select(_b.id)
                .where(_b.state.in_(("in_progress", "canceling")), _b.expires_at <= now)
                .order_by(_b.expires_at, _b.id)
            ).scalars()
            for batch_id in due.all():
                num_expired = conn.execute(
                    update(batch_requests)
                    .where(_r.batch_id == batch_id, _r.status.in_(_ACTIVE))
                    .values(
                        status="expired",
                        finished_at=now,
                        lease_owner=None,
                        lease_expires_at=None,
                    )
                ).rowcount
                if num_expired:
                    touched.append(batch_id)
                    logger.info("batch %s expired %d requests", batch_id, num_expired)
        return touched

    def finish_batches(self, now: float) -> list[str]:
        """Batches with no queued or leased request left become ended; returns their ids.

        ended_reason: canceled if a cancel was asked for, else expired if any request
        expired, else completed.
        """
        active = exists().where(_r.batch_id == _b.id, _r.status.in_(_ACTIVE))
        expired = exists().where(_r.batch_id == _b.id, _r.status == "expired")
        ended = []
        with self.engine.begin() as conn:
            candidates = conn.execute(
                select(_b.id, _b.state, expired)
                .where(_b.state.in_(("in_progress", "canceling")), ~active)
                .order_by(_b.created_at, _b.id)
            ).all()
            for batch_id, state, has_expired in candidates:
                if state == "canceling":
                    reason = "canceled"
                else:
                    reason = "expired" if has_expired else "completed"
                # The state guard makes one of two racing gateways the one that ends it.
                if conn.execute(
                    update(batches)
                    .where(_b.id == batch_id, _b.state == state)
                    .values(state="ended", ended_at=now, ended_reason=reason)
                ).rowcount:
                    ended.append(batch_id)
                    logger.info("batch %s ended: %s", batch_id, reason)
        return ended

    def archive_batches(
        self, now: float, retention_seconds: float = ARCHIVE_AFTER_SECONDS
    ) -> list[str]:
        """Ended batches created more than `retention_seconds` ago lose their request rows.

        The batch row stays (with archived_at set and its final counts); results are no
        longer downloadable. Returns the ids archived.
        """
        archived = []
        with self.engine.begin() as conn:
            due = conn.execute(
                select(_b.id).where(
                    _b.state == "ended",
                    _b.archived_at.is_(None),
                    _b.created_at <= now - retention_seconds,
                )
            ).scalars()
            for batch_id in due.all():
                counts = dict.fromkeys(REQUEST_STATUSES, 0) | _counts(conn, batch_id)
                if conn.execute(
                    update(batches)
                    .where(_b.id == batch_id, _b.archived_at.is_(None))
                    .values(archived_at=now, archived_counts=json.dumps(counts))
                ).rowcount:
                    conn.execute(delete(batch_requests).where(_r.batch_id == batch_id))
                    archived.append(batch_id)
        if archived:
            logger.info("archived %d batches", len(archived))
        return archived

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

    # --- requests and leases -------------------------------------------------------------

    def lease(
        self, owner: str, max_requests: int, lease_seconds: float, now: float
    ) -> list[LeasedRequest]:
        """Claims up to `max_requests` queued requests for `owner` until now + lease_seconds.

        Earliest deadline first (batch expires_at, then created_at), and within a batch
        grouped by prefix_key, then idx, so requests sharing a prompt prefix come together.
        Each claim bumps the request's attempts and lease_epoch.
        """
        # Two statements, not UPDATE ... WHERE key IN (SELECT ... LIMIT n): PostgreSQL may
        # plan that as a nested-loop semi join that reruns the subquery for every row, and
        # so claim more than n rows (seen: 6 of 6 for LIMIT 4).
        picked = (
            select(_r.batch_id, _r.idx)
            .where(_r.status == "queued", _r.deadline > now)
            .order_by(_r.deadline, _r.submitted_at, _r.batch_id, _r.prefix_key, _r.idx)
            .limit(max_requests)
            .with_for_update(skip_locked=True)  # PostgreSQL; SQLite compiles it away
        )
        with self.engine.begin() as conn:
            keys = [(row.batch_id, row.idx) for row in conn.execute(picked)]
            idxs_by_batch: dict[str, list[int]] = {}
            for batch_id, idx in keys:
                idxs_by_batch.setdefault(batch_id, []).append(idx)
            claimed: dict[tuple[str, int], Row[Any]] = {}
            targets: dict[str, Row[Any]] = {}
            # Per batch `idx IN (...)`: a (batch_id, idx) IN list costs PostgreSQL more to
            # plan than to run.
            for batch_id, idxs in idxs_by_batch.items():
                for row in conn.execute(
                    update(batch_requests)
                    .where(_r.batch_id == batch_id, _r.idx.in_(idxs))
                    .values(
                        status="leased",
                        lease_owner=owner,
                        lease_expires_at=now + lease_seconds,
                        lease_epoch=_r.lease_epoch + 1,
                        attempts=_r.attempts + 1,
                    )
                    .returning(_r.idx, _r.custom_id, _r.params, _r.lease_epoch, _r.attempts)
                ):
                    claimed[batch_id, row.idx] = row
                targets[batch_id] = conn.execute(
                    select(_b.endpoint, _b.api).where(_b.id == batch_id)
                ).one()
        if keys:
            logger.debug("%s leased %d requests", owner, len(keys))
        return [
            LeasedRequest(
                batch_id=batch_id,
                idx=idx,
                custom_id=claimed[batch_id, idx].custom_id,
                params=claimed[batch_id, idx].params,
                epoch=claimed[batch_id, idx].lease_epoch,
                attempts=claimed[batch_id, idx].attempts,
                endpoint=targets[batch_id].endpoint,
                api=targets[batch_id].api,
            )
            for batch_id, idx in keys  # in lease order: RETURNING keeps none
        ]

    def complete(
        self,
        batch_id: str,
        idx: int,
        epoch: int,
        status: RequestStatus,
        result_json: str | None,
        now: float,
    ) -> bool:
        """Records a leased request's outcome (succeeded, errored or canceled).

        False, and nothing written, when the lease is no longer current: the request was
        requeued, expired or completed since, e.g. a cut-off engine reporting late.
        """
        if status not in _FINAL_BY_COMPLETE:
            raise ValueError(f"complete() takes one of {_FINAL_BY_COMPLETE}, got {status!r}")
        with self.engine.begin() as conn:
            return bool(
                conn.execute(
                    update(batch_requests)
                    .where(_lease_is(batch_id, idx, epoch))
                    .values(
                        status=status,
                        result=result_json,
                        finished_at=now,
                        lease_owner=None,
                        lease_expires_at=None,
                    )
                ).rowcount
            )

    def complete_many(self, outcomes: Sequence[Outcome], now: float) -> int:
        """complete() for many requests in one transaction and one prepared statement (the
        dispatcher's group commit); returns how many were accepted."""
        if not outcomes:
            return 0
        for o in outcomes:
            if o.status not in _FINAL_BY_COMPLETE:
                raise ValueError(f"complete() takes one of {_FINAL_BY_COMPLETE}, got {o.status!r}")
        statement = (
            update(batch_requests)
            .where(
                _r.batch_id == bindparam("b_batch_id"),
                _r.idx == bindparam("b_idx"),
                _r.status == "leased",
                _r.lease_epoch == bindparam("b_epoch"),
            )
            .values(
                status=bindparam("b_status"),
                result=bindparam("b_result"),
                finished_at=now,
                lease_owner=None,
                lease_expires_at=None,
            )
        )
        rows = [
            {
                "b_batch_id": o.batch_id,
                "b_idx": o.idx,
                "b_epoch": o.epoch,
                "b_status": o.status,
                "b_result": o.result_json,
            }
            for o in outcomes
        ]
        with self.engine.begin() as conn:
            return int(conn.execute(statement, rows).rowcount)

    def release(
        self,
        batch_id: str,
        idx: int,
        epoch: int,
        now: float,
        error_json: str | None = None,
        max_attempts: int = 3,
    ) -> RequestStatus | None:
        """Gives a leased request back after an engine failure.

        It is queued again, or errored (with `error_json` as its result) once it has been
        leased `max_attempts` times, or canceled if its batch is canceling. Returns the
        new status, or None when the lease was no longer current.
        """
        with self.engine.begin() as conn:
            statuses = _end_leases(
                conn, _lease_is(batch_id, idx, epoch), now, error_json, max_attempts
            )
        return statuses[0] if statuses else None

    def requeue_owner(
        self, owner: str, now: float, error_json: str | None = None, max_attempts: int = 3
    ) -> int:
        """Ends every lease `owner` holds (a dead engine, a restarted gateway) as release()
        does; returns how many. Their late results are refused."""
        with self.engine.begin() as conn:
            num = len(_end_leases(conn, _r.lease_owner == owner, now, error_json, max_attempts))
        if num:
            logger.info("requeued %d requests leased by %s", num, owner)
        return num

    def renew_leases(self, owner: str, lease_seconds: float, now: float) -> int:
        """Extends every lease `owner` holds to now + lease_seconds; returns how many.

        A gateway calls it while its requests run, so that only a gateway that stopped
        renewing (a dead one) loses its leases to requeue_expired_leases().
        """
        with self.engine.begin() as conn:
            return conn.execute(
                update(batch_requests)
                .where(_r.status == "leased", _r.lease_owner == owner)
                .values(lease_expires_at=now + lease_seconds)
            ).rowcount

    def requeue_expired_leases(
        self, now: float, error_json: str | None = None, max_attempts: int = 3
    ) -> int:
        """Ends every lease past its lease_expires_at as release() does; returns how many.

        This is how the leases of a gateway that died without a word come back.
        """
        with self.engine.begin() as conn:
            num = len(_end_leases(conn, _r.lease_expires_at <= now, now, error_json, max_attempts))
        if num:
            logger.info("requeued %d requests whose lease expired", num)
        return num

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

    # --- files ---------------------------------------------------------------------------

    def create_file(self, file: FileRow) -> None:
        """Records an uploaded file's metadata (the gateway has stored its content)."""
        with self.engine.begin() as conn:
            conn.execute(insert(files).values(asdict(file)))

    def get_file(self, file_id: str, owner: str) -> FileRow | None:
        """The file, or None when there is none or it is another owner's."""
        with self._reader.begin() as conn:
            row = conn.execute(
                select(*_FILE_COLUMNS).where(files.c.id == file_id, files.c.owner == owner)
            ).first()
        return None if row is None else FileRow(*row)

    def list_files(
        self,
        owner: str,
        purpose: str | None = None,
        limit: int = 10_000,
        after: str | None = None,
    ) -> tuple[list[FileRow], bool]:
        """One page of this owner's files, newest first, and whether more follow.

        `after`: the id of the last file of the previous page.
        """
        c = files.c
        query = select(*_FILE_COLUMNS).where(c.owner == owner)
        if purpose is not None:
            query = query.where(c.purpose == purpose)
        with self._reader.begin() as conn:
            if after is not None:
                cursor = conn.execute(
                    select(c.created_at, c.id).where(c.id == after, c.owner == owner)
                ).first()
                if cursor is None:
                    raise InvalidRequestError(f"no file {after!r} to page from", param="after")
                query = query.where(_keyset((c.created_at, c.id), tuple(cursor), older=True))
            rows = conn.execute(
                query.order_by(c.created_at.desc(), c.id.desc()).limit(limit + 1)
            ).all()
        return [FileRow(*row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str) -> bool:
        """Forgets the file's metadata; False when there is no such file of this owner."""
        with self.engine.begin() as conn:
            return bool(
                conn.execute(
                    delete(files).where(files.c.id == file_id, files.c.owner == owner)
                ).rowcount
            )


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


def _counts(conn: Connection, batch_id: str) -> dict[RequestStatus, int]:
    rows = conn.execute(
        select(_r.status, func.count()).where(_r.batch_id == batch_id).group_by(_r.status)
    ).all()
    return {status: num for status, num in rows}


def _keyset(
    key: Sequence[ColumnElement[Any]], cursor: Sequence[Any], *, older: bool
) -> ColumnElement[bool]:
    """Rows strictly older (or newer) than `cursor` in (created_at, id) order."""
    (time_col, id_col), (time, id_) = key, cursor
    if older:
        return or_(time_col < time, and_(time_col == time, id_col < id_))
    return or_(time_col > time, and_(time_col == time, id_col > id_))


def _lease_is(batch_id: str, idx: int, epoch: int) -> ColumnElement[bool]:
    return and_(
        _r.batch_id == batch_id, _r.idx == idx, _r.status == "leased", _r.lease_epoch == epoch
    )


def _end_leases(
    conn: Connection,
    which: ColumnElement[bool],
    now: float,
    error_json: str | None,
    max_attempts: int,
) -> list[RequestStatus]:
    """Ends the leases `which` selects without a result; returns each one's new status."""
    canceling = exists().where(_b.id == _r.batch_id, _b.state == "canceling")
    exhausted = _r.attempts >= max_attempts  # SET sees the old row: attempts of this lease
    return list(
        conn.execute(
            update(batch_requests)
            .where(_r.status == "leased", which)
            .values(
                status=case((canceling, "canceled"), (exhausted, "errored"), else_="queued"),
                result=case(
                    (
                        and_(~canceling, exhausted),
                        literal(error_json, Text()),
                    ),
                    else_=null(),
                ),
                finished_at=case((or_(canceling, exhausted), now), else_=null()),
                lease_owner=None,
                lease_expires_at=None,
            )
            .returning(_r.status)
        ).scalars()
    )


def _set_wal(cursor: Any) -> None:
    """Switch the database to WAL. Several processes (or threads) opening a new file at
    once race for that first switch, and SQLite answers the losers "database is locked"
    at once, without waiting its busy timeout: retry within that timeout."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _configure_sqlite(engine: Engine) -> None:
    """WAL and a busy timeout on every connection; BEGIN IMMEDIATE for each write.

    pysqlite's own transaction handling is switched off so that SQLAlchemy's begin
    event decides how each transaction starts.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        _set_wal(cursor)
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        read_only = conn.get_execution_options().get("tokenfleet_read_only", False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
