"""The durable batch store: batches, their requests and leases, and file metadata.

SQLAlchemy Core over SQLite (one gateway) or PostgreSQL (several gateways sharing one
database). Every method is one transaction and takes the current time as an argument.
BatchStore joins the parts, each in its own module:

    database.py   engine, SQLite/PostgreSQL setup, migrations, errors (StoreBase)
    batches.py    create, get, list, count, cancel, delete a batch; read its results
    leases.py     lease requests, record results, give leases back or renew them
    lifecycle.py  expire, end and archive batches as time goes by
    files.py      file metadata
"""

from __future__ import annotations

from tokenfleet.batch.batches import (
    ANALYZE_AFTER_ROWS,
    INSERT_CHUNK,
    BatchesMixin,
    BatchNotEnded,
)
from tokenfleet.batch.database import (
    SQLITE_BUSY_TIMEOUT_MS,
    BatchStoreError,
    QuotaExceeded,
    SchemaTooNew,
    engine_url,
)
from tokenfleet.batch.files import FilesMixin
from tokenfleet.batch.leases import LeasesMixin
from tokenfleet.batch.lifecycle import ARCHIVE_AFTER_SECONDS, LifecycleMixin

__all__ = [
    "ANALYZE_AFTER_ROWS",
    "ARCHIVE_AFTER_SECONDS",
    "INSERT_CHUNK",
    "SQLITE_BUSY_TIMEOUT_MS",
    "BatchNotEnded",
    "BatchStore",
    "BatchStoreError",
    "QuotaExceeded",
    "SchemaTooNew",
    "engine_url",
]


class BatchStore(BatchesMixin, LeasesMixin, LifecycleMixin, FilesMixin):
    """Batches, requests and files in one database; migrates it when opened.

    Thread-safe: each method checks a connection out of the engine's pool. Several
    stores (threads, processes, gateways) may share one database.
    """
