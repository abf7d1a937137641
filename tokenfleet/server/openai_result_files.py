"""An ended OpenAI batch's output and error files: their lines, rendered from the stored
results in input order, and their registration as files of the batch's owner.

    batch ends ──on_finished──► ResultFiles.register_soon ──(worker thread)──►
        count each file's lines and bytes ─► FileRow "batch:<id>:output" / ":error"
        ─► set_result_files() ─► the batch shows completed | expired | cancelled

The files' content is never stored: GET /v1/files/{id}/content renders it again from
the results, a chunk at a time. Only a file with at least one line is registered.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal

from sqlalchemy.exc import IntegrityError

from tokenfleet.batch.schema import FileRow, ResultRow
from tokenfleet.batch.store import BatchStore
from tokenfleet.server.batch_state import BatchState

logger = logging.getLogger(__name__)

Kind = Literal["output", "error"]
KINDS: tuple[Kind, ...] = ("output", "error")
LOCATION_PREFIX = "batch:"
# A request that has no response: why, as OpenAI's error file says it.
NO_RESPONSE = {
    "canceled": ("batch_cancelled", "the batch was cancelled before this request completed"),
    "expired": ("batch_expired", "the batch expired before this request completed"),
    "errored": ("batch_request_failed", "the request failed on every attempt"),
}


def result_line(batch_id: str, row: ResultRow) -> tuple[Kind, str]:
    """Which file one request's line belongs in, and the line (with its newline).

    Deterministic, so that the size counted at registration is the size served.
    """
    digest = hashlib.blake2b(f"{batch_id}:{row.idx}".encode(), digest_size=12).hexdigest()
    response, error = None, None
    if row.status in ("succeeded", "errored") and row.result is not None:
        stored = json.loads(row.result)  # ResultFormats: {"status_code", "body"}
        response = {
            "status_code": stored["status_code"],
            "request_id": f"req_{digest}",
            "body": stored["body"],
        }
    else:
        code, message = NO_RESPONSE.get(row.status, ("batch_request_failed", row.status))
        error = {"code": code, "message": message}
    kind: Kind = "output" if row.status == "succeeded" else "error"
    line = {
        "id": f"batch_req_{digest}",
        "custom_id": row.custom_id,
        "response": response,
        "error": error,
    }
    return kind, json.dumps(line) + "\n"


def location(batch_id: str, kind: Kind) -> str:
    return f"{LOCATION_PREFIX}{batch_id}:{kind}"


def parse_location(value: str) -> tuple[str, Kind] | None:
    """(batch id, kind) of a result file's location; None for an uploaded file."""
    if not value.startswith(LOCATION_PREFIX):
        return None
    batch_id, _, kind = value[len(LOCATION_PREFIX) :].rpartition(":")
    assert kind in KINDS, value
    return batch_id, kind


def file_id(batch_id: str, kind: Kind) -> str:
    """The same id whoever registers it, so that two racing registrations make one file."""
    return "file-" + hashlib.blake2b(f"{batch_id}:{kind}".encode(), digest_size=12).hexdigest()


async def stream_lines(state: BatchState, batch_id: str, kind: Kind) -> AsyncIterator[bytes]:
    """One result file's content, in input order, a chunk of results at a time."""
    async for chunk in state.iter_results(batch_id):
        lines = [line for k, line in (result_line(batch_id, r) for r in chunk) if k == kind]
        if lines:
            yield "".join(lines).encode()


def register(store: BatchStore, batch_id: str, now: float) -> None:
    """Registers the result files of an ended OpenAI batch that has none yet (blocking: one
    pass over its results)."""
    batch = store.get_batch_any_owner(batch_id)
    if batch is None or batch.api != "openai" or batch.state != "ended":
        return
    if batch.errors is not None or batch.output_file_id or batch.error_file_id:
        return
    num_lines = dict.fromkeys(KINDS, 0)
    num_bytes = dict.fromkeys(KINDS, 0)
    for row in store.iter_results(batch_id):
        kind, line = result_line(batch_id, row)
        num_lines[kind] += 1
        num_bytes[kind] += len(line.encode())
    ids: dict[Kind, str | None] = dict.fromkeys(KINDS)
    for kind in KINDS:
        if not num_lines[kind]:
            continue
        file = FileRow(
            id=file_id(batch_id, kind),
            owner=batch.owner,
            purpose="batch_output",
            filename=f"{batch_id}_{kind}.jsonl",
            bytes=num_bytes[kind],
            created_at=now,
            status="processed",
            location=location(batch_id, kind),
        )
        try:
            store.create_file(file)
        except IntegrityError:
            logger.info("result file %s of %s registered meanwhile", file.id, batch_id)
        ids[kind] = file.id
    store.set_result_files(batch_id, ids["output"], ids["error"])
    logger.info("batch %s: output file %s, error file %s", batch_id, ids["output"], ids["error"])


class ResultFiles:
    """The dispatcher's on_finished hook: registers ended batches' result files in the
    background (a pass over a large batch's results takes a while), each batch once at a
    time. Idempotent, so the routes call it too for a batch found ended without files
    (ended by another gateway, or before a restart)."""

    def __init__(self, store: BatchStore, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self._running: dict[str, asyncio.Task[None]] = {}

    def register_soon(self, batch_ids: list[str]) -> None:
        for batch_id in batch_ids:
            if batch_id not in self._running:
                task = asyncio.create_task(self._register(batch_id))
                self._running[batch_id] = task

    async def _register(self, batch_id: str) -> None:
        try:
            await asyncio.to_thread(register, self.store, batch_id, self.clock())
        except Exception:
            logger.exception("registering the result files of %s failed", batch_id)
        finally:
            self._running.pop(batch_id, None)
