"""Anthropic Message Batches: /v1/messages/batches (create, retrieve, list, cancel, delete,
results). The store holds them; the dispatcher runs them."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from tokenfleet.batch.schema import BatchRow, NewBatch
from tokenfleet.batch.store import BatchNotEnded
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server.anthropic_api import MessagesRequest
from tokenfleet.server.batch_input import (
    CUSTOM_ID,
    BatchChecker,
    anthropic_requests,
    new_requests,
)
from tokenfleet.server.batch_state import BatchState, owner_of, spool_body
from tokenfleet.server.bounds import CURSOR_PATTERN, MAX_CURSOR_CHARS
from tokenfleet.server.errors import APIError
from tokenfleet.server.schemas import request_body

router = APIRouter()
PATH = "/v1/messages/batches"


class BatchItem(BaseModel):
    """One request of a Message Batch (the body is read by batch_input; this describes it)."""

    custom_id: str = Field(min_length=1, max_length=64, pattern=CUSTOM_ID.pattern)
    params: MessagesRequest


class CreateMessageBatch(BaseModel):
    requests: list[BatchItem] = Field(min_length=1, max_length=100_000)


def public_base_url(request: Request) -> str:
    """The URL this server is reached at, for the URLs it hands out: the configured public
    base URL (ServeConfig.public_base_url), else what a reverse proxy says
    (X-Forwarded-Proto, -Host, -Prefix), else the request's own."""
    configured: str | None = request.app.state.config.public_base_url
    if configured:
        return configured.rstrip("/")
    headers = request.headers
    proto = _first(headers.get("x-forwarded-proto")) or request.url.scheme
    host = _first(headers.get("x-forwarded-host")) or headers.get("host") or request.url.netloc
    prefix = _first(headers.get("x-forwarded-prefix")) or ""
    prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
    if proto not in ("http", "https") or not _HOST.fullmatch(host) or not _PREFIX.fullmatch(prefix):
        return str(request.base_url).rstrip("/")  # a header that is no URL part: ignored
    return f"{proto}://{host}{prefix}"


_HOST = re.compile(r"[A-Za-z0-9.\-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")
_PREFIX = re.compile(r"(/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)*")


def _first(value: str | None) -> str | None:
    """A forwarded header's first (the client-side proxy's) value."""
    return value.split(",")[0].strip() if value else None


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def batch_object(request: Request, row: BatchRow, counts: dict[str, int]) -> dict[str, Any]:
    ended = row.state == "ended"
    results_url = None
    if ended and row.archived_at is None:
        results_url = public_base_url(request) + f"{PATH}/{row.id}/results"
    return {
        "id": row.id,
        "type": "message_batch",
        "processing_status": row.state,
        "request_counts": {
            "processing": counts.get("queued", 0) + counts.get("leased", 0),
            "succeeded": counts.get("succeeded", 0),
            "errored": counts.get("errored", 0),
            "canceled": counts.get("canceled", 0),
            "expired": counts.get("expired", 0),
        },
        "ended_at": iso(row.ended_at),
        "created_at": iso(row.created_at),
        "expires_at": iso(row.expires_at),
        "cancel_initiated_at": iso(row.cancel_initiated_at),
        "archived_at": iso(row.archived_at),
        "results_url": results_url,
    }


async def _object(request: Request, state: BatchState, row: BatchRow) -> dict[str, Any]:
    return batch_object(request, row, await state.db(state.store.request_counts, row.id))


async def _get(request: Request, state: BatchState, batch_id: str) -> BatchRow:
    row = await state.db(state.store.get_batch, batch_id, owner_of(request))
    if row is None or row.api != "anthropic":
        raise APIError(404, "not_found", f"message batch {batch_id!r} not found")
    return row


@router.post(PATH, openapi_extra=request_body(CreateMessageBatch))
async def create_batch(request: Request) -> JSONResponse:
    state: BatchState = request.app.state.batches
    owner = owner_of(request)
    with await spool_body(request, state.config.max_batch_bytes) as source:

        def check() -> None:
            checker = BatchChecker(request.app.state.service, state.config.max_batch_requests)
            for where, custom_id, params in anthropic_requests(source):
                checker.check(where, custom_id, "/v1/messages", params)
            if not checker.seen:
                raise APIError(
                    400, "invalid_request", "requests: at least one request", param="requests"
                )

        await asyncio.to_thread(check)
        source.seek(0)
        now = state.clock()
        batch = NewBatch(
            id=f"msgbatch_{uuid.uuid4().hex[:24]}",
            api="anthropic",
            owner=owner,
            endpoint="/v1/messages",
            created_at=now,
            expires_at=now + state.config.batch_expiry_s,
            idempotency_key=request.headers.get("idempotency-key"),
        )
        row = await state.db(
            state.store.create_batch, batch, new_requests(anthropic_requests(source))
        )
    state.dispatcher.wake()
    return JSONResponse(await _object(request, state, row))


@router.get(PATH)
async def list_batches(
    request: Request,
    limit: int = Query(20, ge=1, le=1000),
    before_id: str | None = Query(None, max_length=MAX_CURSOR_CHARS, pattern=CURSOR_PATTERN),
    after_id: str | None = Query(None, max_length=MAX_CURSOR_CHARS, pattern=CURSOR_PATTERN),
) -> JSONResponse:
    state: BatchState = request.app.state.batches
    try:
        rows, has_more = await state.db(
            state.store.list_batches, "anthropic", owner_of(request), limit, after_id, before_id
        )
    except InvalidRequestError as exc:  # a cursor that names no batch of the caller's
        message = f"{exc.param}: {exc.message}" if exc.param else exc.message
        raise APIError(400, "invalid_request", message, param=exc.param) from exc
    data = [await _object(request, state, row) for row in rows]
    return JSONResponse(
        {
            "data": data,
            "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


@router.get(PATH + "/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> JSONResponse:
    state: BatchState = request.app.state.batches
    return JSONResponse(await _object(request, state, await _get(request, state, batch_id)))


@router.post(PATH + "/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
    state: BatchState = request.app.state.batches
    await _get(request, state, batch_id)
    row = await state.db(state.store.cancel_batch, batch_id, owner_of(request), state.clock())
    if row is None:
        raise APIError(404, "not_found", f"message batch {batch_id!r} not found")
    await state.dispatcher.cancel(batch_id)
    await state.db(state.store.finish_batches, state.clock())
    return JSONResponse(await _object(request, state, await _get(request, state, batch_id)))


@router.delete(PATH + "/{batch_id}")
async def delete_batch(request: Request, batch_id: str) -> JSONResponse:
    state: BatchState = request.app.state.batches
    await _get(request, state, batch_id)
    try:
        await state.db(state.store.delete_batch, batch_id, owner_of(request))
    except BatchNotEnded as exc:
        raise APIError(
            400,
            "invalid_request",
            f"message batch {batch_id!r} is still processing; cancel it and wait for it to end "
            "before deleting it",
        ) from exc
    return JSONResponse({"id": batch_id, "type": "message_batch_deleted"})


@router.get(PATH + "/{batch_id}/results")
async def batch_results(request: Request, batch_id: str) -> StreamingResponse:
    state: BatchState = request.app.state.batches
    row = await _get(request, state, batch_id)
    if row.state != "ended":
        raise APIError(
            400, "invalid_request", f"message batch {batch_id!r} has not ended; no results yet"
        )
    if row.archived_at is not None:
        raise APIError(404, "not_found", f"the results of {batch_id!r} are no longer kept")

    async def lines() -> AsyncIterator[bytes]:
        async for chunk in state.iter_results(batch_id):
            out = []
            for r in chunk:
                if r.status in ("succeeded", "errored") and r.result is not None:
                    result = json.loads(r.result)
                else:
                    result = {"type": r.status}  # canceled, expired
                out.append(json.dumps({"custom_id": r.custom_id, "result": result}) + "\n")
            yield "".join(out).encode()

    return StreamingResponse(lines(), media_type="application/x-jsonl")
