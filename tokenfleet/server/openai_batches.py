"""OpenAI Batches: /v1/batches (create, retrieve, list, cancel) over an uploaded input
file; the Files routes come along on the same router. The store holds the batches, the
dispatcher runs them, openai_result_files makes their output and error files.

Status, from the stored state (a batch is checked whole before it is stored, so it is
never seen "validating"):

    in_progress ──cancel──► cancelling ──► cancelled
         │                                     ▲ once its result files are registered
         └──► finalizing ──► completed | expired
    failed: a line of the input file was refused (errors says which), no request stored
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from tokenfleet.batch.schema import BatchRow, NewBatch, RequestStatus
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server import openai_files
from tokenfleet.server.batch_input import (
    OPENAI_ENDPOINTS,
    BatchChecker,
    new_requests,
    openai_requests,
)
from tokenfleet.server.batch_state import BatchState, owner_of
from tokenfleet.server.body import read_body
from tokenfleet.server.bounds import CURSOR_PATTERN, MAX_CURSOR_CHARS
from tokenfleet.server.errors import APIError, openai_error_body
from tokenfleet.server.schemas import request_body
from tokenfleet.server.service import GenerationService

router = APIRouter()
router.include_router(openai_files.router)
PATH = "/v1/batches"
COMPLETION_WINDOWS = ("24h",)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
_LINE = re.compile(r"line (\d+)(?:\.(.+))?")


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def batch_status(row: BatchRow) -> str:
    if row.state == "in_progress":
        return "in_progress"
    if row.state == "canceling":
        return "cancelling"
    if row.ended_reason == "failed":
        return "failed"
    # Ended: terminal only once its result files are registered (or its results are gone).
    pending = row.output_file_id is None and row.error_file_id is None
    pending = pending and row.archived_at is None
    if row.ended_reason == "canceled":
        return "cancelling" if pending else "cancelled"
    if pending:
        return "finalizing"
    return "expired" if row.ended_reason == "expired" else "completed"


def batch_object(row: BatchRow, counts: dict[RequestStatus, int]) -> dict[str, Any]:
    status = batch_status(row)
    ended = None if row.ended_at is None else int(row.ended_at)

    def ended_if(*statuses: str) -> int | None:
        return ended if status in statuses else None

    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": None if row.errors is None else json.loads(row.errors),
        "input_file_id": row.input_file_id,
        "completion_window": "24h",
        "status": status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": int(row.created_at),
        "in_progress_at": None if status == "failed" else int(row.created_at),
        "expires_at": int(row.expires_at),
        "finalizing_at": ended if row.ended_reason in ("completed", "expired") else None,
        "completed_at": ended_if("completed"),
        "failed_at": ended_if("failed"),
        "expired_at": ended_if("expired"),
        "cancelling_at": None if row.cancel_initiated_at is None else int(row.cancel_initiated_at),
        "cancelled_at": ended_if("cancelled"),
        "request_counts": {
            "total": sum(counts.values()),
            "completed": counts.get("succeeded", 0),
            # Every request that has a line in the error file.
            "failed": sum(counts.get(s, 0) for s in ("errored", "canceled", "expired")),
        },
        "metadata": json.loads(row.metadata),
    }


async def _object(state: BatchState, row: BatchRow) -> dict[str, Any]:
    obj = batch_object(row, await state.db(state.store.request_counts, row.id))
    if obj["status"] in ("finalizing", "cancelling") and row.state == "ended":
        # Ended elsewhere (another gateway) or before a restart: make its files now.
        state.dispatcher.on_finished([row.id])
    return obj


async def _get(request: Request, state: BatchState, batch_id: str) -> BatchRow:
    row = await state.db(state.store.get_batch, batch_id, owner_of(request))
    if row is None or row.api != "openai":
        raise APIError(404, "invalid_request", f"No such Batch object: {batch_id}", param="id")
    return row


def _check_create(body: CreateBatchRequest) -> None:
    if body.endpoint not in OPENAI_ENDPOINTS:
        raise APIError(
            400,
            "invalid_request",
            f"endpoint: {body.endpoint!r} is not supported; use one of {list(OPENAI_ENDPOINTS)}",
            param="endpoint",
        )
    if body.completion_window not in COMPLETION_WINDOWS:
        raise APIError(
            400,
            "invalid_request",
            f"completion_window: {body.completion_window!r} is not supported; use '24h'",
            param="completion_window",
        )
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS or any(
        len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()
    ):
        raise APIError(
            400,
            "invalid_request",
            f"metadata: at most {MAX_METADATA_PAIRS} pairs, keys of at most "
            f"{MAX_METADATA_KEY} characters, values of at most {MAX_METADATA_VALUE}",
            param="metadata",
        )


def batch_error(exc: APIError) -> dict[str, Any]:
    """An input file's problem as an entry of the batch's `errors`; BatchChecker names the
    line and field in `param` ("line 3.params.model": here "body.model")."""
    match = _LINE.fullmatch(exc.param or "")
    line = int(match[1]) if match else None
    field = match[2] if match else None
    if field is not None and field.split(".")[0] == "params":
        field = "body" + field[len("params") :]
    text = exc.message.removeprefix(f"{exc.param}: ")
    where = ", ".join(p for p in (None if line is None else f"line {line}", field) if p)
    # The sync API's own code (model_not_found, ...) of a body BatchChecker refused.
    cause = exc.__cause__ if isinstance(exc.__cause__, APIError) else exc
    code = openai_error_body(cause.kind, text, None)["error"]["code"] or "invalid_request"
    message = f"{where}: {text}" if where else text
    return {"code": code, "message": message, "param": field, "line": line}


def check_input(
    service: GenerationService, max_requests: int, path: Path, endpoint: str
) -> str | None:
    """Every line of the input file checked as the sync API checks it (blocking); None if
    all are good, else the batch's `errors` (JSON) naming the first bad line."""
    checker = BatchChecker(service, max_requests)
    try:
        with path.open("rb") as source:
            for where, custom_id, url, body in openai_requests(source, endpoint):
                checker.check(where, custom_id, url, body)
        if not checker.seen:
            raise APIError(400, "invalid_request", "the input file has no requests")
    except APIError as exc:
        return json.dumps({"object": "list", "data": [batch_error(exc)]})
    return None


@router.post(PATH, openapi_extra=request_body(CreateBatchRequest))
async def create_batch(request: Request) -> JSONResponse:
    state: BatchState = request.app.state.batches
    owner = owner_of(request)
    body = await read_body(request, CreateBatchRequest)
    _check_create(body)
    file = await state.db(state.store.get_file, body.input_file_id, owner)
    if file is None:
        raise openai_files.not_found(body.input_file_id, "input_file_id")
    if file.purpose != "batch":
        raise APIError(
            400,
            "invalid_request",
            f"input_file_id: {file.id} has purpose {file.purpose!r}, not 'batch'",
            param="input_file_id",
        )
    path = openai_files.uploaded_path(state, file)
    if not path.is_file():
        raise APIError(404, "invalid_request", f"the content of {file.id} is gone")
    service = request.app.state.service
    errors = await asyncio.to_thread(
        check_input, service, state.config.max_batch_requests, path, body.endpoint
    )
    now = state.clock()
    batch = NewBatch(
        id=f"batch_{uuid.uuid4().hex[:24]}",
        api="openai",
        owner=owner,
        endpoint=body.endpoint,
        created_at=now,
        expires_at=now + state.config.batch_expiry_s,
        metadata=json.dumps(body.metadata),
        idempotency_key=request.headers.get("idempotency-key"),
        input_file_id=file.id,
        errors=errors,
    )

    def create() -> BatchRow:  # on the store thread; the file is read a second time
        if errors is not None:
            return state.store.create_batch(batch, ())
        with path.open("rb") as source:
            entries = ((w, c, b) for w, c, _, b in openai_requests(source, body.endpoint))
            return state.store.create_batch(batch, new_requests(entries))

    row = await state.db(create)
    state.dispatcher.wake()
    return JSONResponse(await _object(state, row))


@router.get(PATH)
async def list_batches(
    request: Request,
    limit: int = Query(20, ge=1, le=100),
    after: str | None = Query(None, max_length=MAX_CURSOR_CHARS, pattern=CURSOR_PATTERN),
) -> JSONResponse:
    state: BatchState = request.app.state.batches
    try:
        rows, has_more = await state.db(
            state.store.list_batches, "openai", owner_of(request), limit, after
        )
    except InvalidRequestError as exc:
        raise APIError(400, "invalid_request", exc.message, param="after") from exc
    data = [await _object(state, row) for row in rows]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


@router.get(PATH + "/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> JSONResponse:
    state: BatchState = request.app.state.batches
    return JSONResponse(await _object(state, await _get(request, state, batch_id)))


@router.post(PATH + "/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
    state: BatchState = request.app.state.batches
    await _get(request, state, batch_id)
    await state.db(state.store.cancel_batch, batch_id, owner_of(request), state.clock())
    await state.dispatcher.cancel(batch_id)
    ended = await state.db(state.store.finish_batches, state.clock())
    if ended:
        state.dispatcher.on_finished(ended)
    return JSONResponse(await _object(state, await _get(request, state, batch_id)))
