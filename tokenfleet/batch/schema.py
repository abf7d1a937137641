"""What the batch store keeps: its tables, their migrations, and the rows it hands out.

Request states (`batch_requests.status`); one row per request of a batch:

    queued ──lease()──► leased ──complete(epoch)──► succeeded | errored | canceled
      │                   │
      │                   └─ release() / requeue_owner() / requeue_expired_leases():
      │                        batch canceling   ─► canceled
      │                        failures >= max   ─► errored  (only an ending with an error
      │                                                       counts a failure)
      │                        otherwise         ─► queued  (the next lease bumps lease_epoch,
      │                                                      so the old holder's result is refused)
      ├─ cancel_batch() ───► canceled
      └─ expire_batches() ─► expired   (leased rows of an expired batch too)

Batch states (`batches.state`): in_progress ─cancel─► canceling ─► ended, or
in_progress ─► ended; `ended_reason` says why: completed | canceled | expired | failed.
Invariant the lease query relies on: a queued request belongs to an in_progress batch
(cancel turns queued rows into canceled in the transaction that marks the batch
canceling, and a lease that ends in a canceling batch ends as canceled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import (
    Column,
    Connection,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)

Api = Literal["anthropic", "openai"]
BatchState = Literal["in_progress", "canceling", "ended"]
EndedReason = Literal["completed", "canceled", "expired", "failed"]
RequestStatus = Literal["queued", "leased", "succeeded", "errored", "canceled", "expired"]
REQUEST_STATUSES: tuple[RequestStatus, ...] = (
    "queued",
    "leased",
    "succeeded",
    "errored",
    "canceled",
    "expired",
)

metadata = MetaData()

schema_version = Table(
    "schema_version",
    metadata,
    Column("version", Integer, primary_key=True),
)

batches = Table(
    "batches",
    metadata,
    Column("id", Text, primary_key=True),
    Column("api", Text, nullable=False),
    Column("owner", Text, nullable=False),
    Column("endpoint", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("ended_reason", Text),
    Column("num_requests", Integer, nullable=False),
    Column("created_at", Double, nullable=False),
    Column("expires_at", Double, nullable=False),
    Column("cancel_initiated_at", Double),
    Column("ended_at", Double),
    Column("archived_at", Double),
    Column("input_file_id", Text),
    Column("output_file_id", Text),
    Column("error_file_id", Text),
    Column("metadata", Text, nullable=False),
    Column("errors", Text),
    Column("idempotency_key", Text),
    # request_counts() as they were when archive_batches() deleted the request rows.
    Column("archived_counts", Text),
    UniqueConstraint("owner", "idempotency_key", name="uq_batches_owner_idempotency_key"),
    Index("ix_batches_list", "owner", "api", "created_at", "id"),
    Index("ix_batches_state", "state", "expires_at"),
)

batch_requests = Table(
    "batch_requests",
    metadata,
    Column("batch_id", Text, ForeignKey("batches.id"), nullable=False),
    Column("idx", Integer, nullable=False),
    Column("custom_id", Text, nullable=False),
    Column("params", Text, nullable=False),
    Column("prefix_key", Text, nullable=False),
    Column("status", Text, nullable=False),
    # The batch's expires_at and created_at, copied so that the lease order is one index
    # scan of this table (no join, no sort of every queued row).
    Column("deadline", Double, nullable=False),
    Column("submitted_at", Double, nullable=False),
    Column("attempts", Integer, nullable=False),  # times leased
    # Attempts that failed through the request itself (its engine died while running it);
    # at max attempts it ends errored. A gateway's stop or a lease's expiry counts none.
    Column("failures", Integer, nullable=False, server_default="0"),
    Column("lease_owner", Text),
    Column("lease_epoch", Integer, nullable=False),
    Column("lease_expires_at", Double),
    Column("result", Text),
    Column("finished_at", Double),
    PrimaryKeyConstraint("batch_id", "idx"),
    Index(
        "ix_batch_requests_lease",
        "status",
        "deadline",
        "submitted_at",
        "batch_id",
        "prefix_key",
        "idx",
    ),
    Index("ix_batch_requests_counts", "batch_id", "status"),
)

files = Table(
    "files",
    metadata,
    Column("id", Text, primary_key=True),
    Column("owner", Text, nullable=False),
    Column("purpose", Text, nullable=False),
    Column("filename", Text, nullable=False),
    Column("bytes", Integer, nullable=False),
    Column("created_at", Double, nullable=False),
    Column("status", Text, nullable=False),
    # Where the content lives (a path under the gateway's file folder, or a content key).
    Column("location", Text, nullable=False),
    Index("ix_files_list", "owner", "purpose", "created_at", "id"),
)

# Interactive rate limits shared by the gateways of one store (limits_store.py): each key
# group's token buckets, refilled continuously, and each gateway's count of the group's
# requests running on it, counted only while its lease (`expires_at`) is current.
rate_buckets = Table(
    "rate_buckets",
    metadata,
    Column("key_group", Text, nullable=False),
    Column("kind", Text, nullable=False),  # requests | tokens
    Column("level", Double, nullable=False),
    Column("at", Double, nullable=False),  # when `level` was last refilled
    Column("granted", Integer, nullable=False),  # whether the last take was granted
    PrimaryKeyConstraint("key_group", "kind"),
)

rate_slots = Table(
    "rate_slots",
    metadata,
    Column("key_group", Text, nullable=False),
    Column("gateway", Text, nullable=False),
    Column("running", Integer, nullable=False),
    Column("expires_at", Double, nullable=False),
    PrimaryKeyConstraint("key_group", "gateway"),
    Index("ix_rate_slots_gateway", "gateway"),
)


def _create_v1_tables(conn: Connection) -> None:
    # Migrations are frozen history: this creates the tables as they stood at version 1
    # (batch_requests without `failures`). When a table changes, add a migration that
    # alters it, and give this one its own copy of that table's version 1 definition.
    v1 = MetaData()
    v1_batches = batches.to_metadata(v1)
    v1_files = files.to_metadata(v1)
    v1_requests = Table(
        "batch_requests",
        v1,
        Column("batch_id", Text, ForeignKey("batches.id"), nullable=False),
        Column("idx", Integer, nullable=False),
        Column("custom_id", Text, nullable=False),
        Column("params", Text, nullable=False),
        Column("prefix_key", Text, nullable=False),
        Column("status", Text, nullable=False),
        Column("deadline", Double, nullable=False),
        Column("submitted_at", Double, nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("lease_owner", Text),
        Column("lease_epoch", Integer, nullable=False),
        Column("lease_expires_at", Double),
        Column("result", Text),
        Column("finished_at", Double),
        PrimaryKeyConstraint("batch_id", "idx"),
        Index(
            "ix_batch_requests_lease",
            "status",
            "deadline",
            "submitted_at",
            "batch_id",
            "prefix_key",
            "idx",
        ),
        Index("ix_batch_requests_counts", "batch_id", "status"),
    )
    v1.create_all(conn, tables=[v1_batches, v1_requests, v1_files])


def _add_failures(conn: Connection) -> None:
    # Version 2: failed attempts apart from leases, so that only a request's own failures
    # use up its attempts.
    conn.execute(text("ALTER TABLE batch_requests ADD COLUMN failures INTEGER NOT NULL DEFAULT 0"))


def _create_rate_tables(conn: Connection) -> None:
    # Version 3: interactive rate limits shared by the gateways of one store. (As frozen
    # history: when these tables change, give this migration its own copy of them.)
    metadata.create_all(conn, tables=[rate_buckets, rate_slots])


# MIGRATIONS[n] takes the schema from version n to n + 1; append, never edit or reorder.
MIGRATIONS: tuple[Callable[[Connection], None], ...] = (
    _create_v1_tables,
    _add_failures,
    _create_rate_tables,
)
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True, slots=True)
class NewBatch:
    """A batch as the gateway creates it; its requests come separately, as an iterable.

    `errors` (JSON) set means the batch failed validation (OpenAI): it is stored as ended
    with `ended_reason` "failed" and must come with no requests.
    """

    id: str
    api: Api
    owner: str
    endpoint: str
    created_at: float
    expires_at: float
    metadata: str = "{}"
    idempotency_key: str | None = None
    input_file_id: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: str | None = None


@dataclass(frozen=True, slots=True)
class NewRequest:
    """One request of a new batch; `params` is JSON the gateway has validated."""

    custom_id: str
    params: str
    prefix_key: str = ""


@dataclass(frozen=True, slots=True)
class BatchRow:
    """A batch as stored. Field names are the `batches` column names."""

    id: str
    api: Api
    owner: str
    endpoint: str
    state: BatchState
    ended_reason: EndedReason | None
    num_requests: int
    created_at: float
    expires_at: float
    cancel_initiated_at: float | None
    ended_at: float | None
    archived_at: float | None
    input_file_id: str | None
    output_file_id: str | None
    error_file_id: str | None
    metadata: str
    errors: str | None
    idempotency_key: str | None


@dataclass(frozen=True, slots=True)
class LeasedRequest:
    """A request claimed by lease(); its result is accepted only under `epoch`."""

    batch_id: str
    idx: int
    custom_id: str
    params: str
    epoch: int
    attempts: int
    endpoint: str
    api: Api
    owner: str = ""  # the batch's owner (a digest of its creator's API key)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A leased request's end, for complete_many(): accepted only under `epoch`."""

    batch_id: str
    idx: int
    epoch: int
    status: RequestStatus
    result_json: str | None


@dataclass(frozen=True, slots=True)
class ResultRow:
    """One request's outcome; `result` is None for canceled and expired requests."""

    idx: int
    custom_id: str
    status: RequestStatus
    result: str | None


@dataclass(frozen=True, slots=True)
class FileRow:
    """A file's metadata; the content itself is the gateway's, at `location`."""

    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    status: str
    location: str
