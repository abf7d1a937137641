"""The batch store's database: engine, dialect handling, migrations, and the base class.

SQLAlchemy Core over SQLite (one gateway) or PostgreSQL (several gateways sharing one
database). On SQLite every connection gets WAL, synchronous=FULL (a commit is on disk
before it returns) and a busy timeout, and every write
transaction is `BEGIN IMMEDIATE` (one writer at a time, WAL for readers); reads go
through `StoreBase._reader`, whose transactions begin deferred. PostgreSQL needs no
such setup: its lease claims use `SELECT ... FOR UPDATE SKIP LOCKED` (see leases.py).

`StoreBase` owns the engine and the migration; the parts of the store (batches.py,
leases.py, lifecycle.py, files.py) build on it and store.py joins them into BatchStore.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Sequence
from typing import Any, Self

from sqlalchemy import (
    ColumnElement,
    Connection,
    Double,
    and_,
    create_engine,
    event,
    func,
    insert,
    literal_column,
    or_,
    select,
)
from sqlalchemy.engine import URL, Engine, make_url

from tokenfleet.batch.schema import MIGRATIONS, schema_version
from tokenfleet.errors import TokenfleetError

# Every part of the store logs under this one name, so that logging configured for
# `tokenfleet.batch.store` covers all of it.
logger = logging.getLogger("tokenfleet.batch.store")

SQLITE_BUSY_TIMEOUT_MS = 30_000
# pg_advisory_xact_lock key that serializes migrate() across processes ("tokenflt").
_MIGRATE_LOCK_KEY = 0x746F6B656E666C74


class BatchStoreError(TokenfleetError):
    """Base of the batch store's own errors."""


class QuotaExceeded(BatchStoreError):
    """A create that would put an owner over a quota (HTTP 429): of requests waiting to
    run, or of stored file bytes. `queued`: what the owners held before this create."""

    def __init__(self, message: str, *, queued: int, quota: int) -> None:
        super().__init__(message)
        self.queued = queued
        self.quota = quota


class SchemaTooNew(BatchStoreError):
    """The database was migrated by a newer tokenfleet than this one."""


def engine_url(url: str) -> URL:
    """`url` with plain `postgresql://` (or `postgres://`) mapped to the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


class StoreBase:
    """One database's engine, opened (and migrated) in the constructor.

    Thread-safe: each method checks a connection out of the engine's pool. Several
    stores (threads, processes, gateways) may share one database.
    """

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        self.url = engine_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        if self.is_sqlite:
            self.engine = create_engine(self.url)
            _configure_sqlite(self.engine, _busy_timeout_ms(self.url))
        else:
            self.engine = create_engine(self.url, pool_pre_ping=True)
        # For reads: the same pool, but on SQLite its transactions begin deferred, so that
        # reads do not queue behind the one writer.
        self._reader = self.engine.execution_options(tokenfleet_read_only=True)
        if migrate:
            self.migrate()

    def db_now(self) -> ColumnElement[float]:
        """The database's clock, in Unix seconds, as SQL: lease expiry is set and judged by
        it, so that gateways whose clocks disagree still agree on which leases expired."""
        if self.is_sqlite:
            return literal_column("((julianday('now') - 2440587.5) * 86400.0)", Double())
        return literal_column(
            "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)", Double()
        )

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
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


def keyset(
    key: Sequence[ColumnElement[Any]], cursor: Sequence[Any], *, older: bool
) -> ColumnElement[bool]:
    """Rows strictly older (or newer) than `cursor` in (created_at, id) order: the page
    condition of list_batches() and list_files()."""
    (time_col, id_col), (time, id_) = key, cursor
    if older:
        return or_(time_col < time, and_(time_col == time, id_col < id_))
    return or_(time_col > time, and_(time_col == time, id_col > id_))


def _busy_timeout_ms(url: URL) -> int:
    """How long a SQLite connection waits for another's lock: the URL's `timeout` in
    seconds (pysqlite's own parameter, `sqlite:///path?timeout=5`) where given, else
    SQLITE_BUSY_TIMEOUT_MS."""
    timeout = url.query.get("timeout")
    if timeout is None:
        return SQLITE_BUSY_TIMEOUT_MS
    return int(float(timeout if isinstance(timeout, str) else timeout[-1]) * 1000)


def _set_wal(cursor: Any, busy_timeout_ms: int) -> None:
    """Switch the database to WAL. Several processes (or threads) opening a new file at
    once race for that first switch, and SQLite answers the losers "database is locked"
    at once, without waiting its busy timeout: retry within that timeout."""
    deadline = time.monotonic() + busy_timeout_ms / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _configure_sqlite(engine: Engine, busy_timeout_ms: int) -> None:
    """WAL and a busy timeout on every connection; BEGIN IMMEDIATE for each write.

    pysqlite's own transaction handling is switched off so that SQLAlchemy's begin
    event decides how each transaction starts.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
        _set_wal(cursor, busy_timeout_ms)
        # FULL: a committed result survives a power loss too, not only a crash of the
        # process (NORMAL in WAL mode may lose the last transactions to a power loss).
        cursor.execute("PRAGMA synchronous = FULL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        read_only = conn.get_execution_options().get("tokenfleet_read_only", False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
