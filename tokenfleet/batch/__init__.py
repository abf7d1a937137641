"""The Batch API's durable state: batches, their requests and leases, and files.

Anthropic Message Batches and OpenAI Files + Batches share this one store.
"""

from __future__ import annotations

from tokenfleet.batch.schema import (
    REQUEST_STATUSES,
    SCHEMA_VERSION,
    Api,
    BatchRow,
    BatchState,
    EndedReason,
    FileRow,
    LeasedRequest,
    NewBatch,
    NewRequest,
    Outcome,
    RequestStatus,
    ResultRow,
)
from tokenfleet.batch.store import (
    ARCHIVE_AFTER_SECONDS,
    BatchNotEnded,
    BatchStore,
    BatchStoreError,
    QuotaExceeded,
    SchemaTooNew,
    engine_url,
)

__all__ = [
    "ARCHIVE_AFTER_SECONDS",
    "REQUEST_STATUSES",
    "SCHEMA_VERSION",
    "Api",
    "BatchNotEnded",
    "BatchRow",
    "BatchState",
    "BatchStore",
    "BatchStoreError",
    "EndedReason",
    "FileRow",
    "LeasedRequest",
    "NewBatch",
    "NewRequest",
    "Outcome",
    "QuotaExceeded",
    "RequestStatus",
    "ResultRow",
    "SchemaTooNew",
    "engine_url",
]
