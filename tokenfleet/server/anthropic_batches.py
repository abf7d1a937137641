"""Anthropic Message Batches: /v1/messages/batches (create, retrieve, list, cancel, delete,
results). The store holds them; the dispatcher runs them."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenfleet.batch.schema import BatchRow, NewBatch
from tokenfleet.batch.store import BatchNotEnded
from tokenfleet.server.batch_input import BatchChecker, anthropic_requests, new_requests
from tokenfleet.server.batch_state import BatchState, owner_of, spool_body
from tokenfleet.server.errors import APIError

router = APIRouter()
PATH = "/v1/messages/batches"


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def batch_object(request: Request, row: BatchRow, counts: dict[str, int]) -> dict[str, Any]:
    ended = row.state == "ended"
    results_url = None
    if ended and row.archived_at is None:
        results_url = str(request.base_url).rstrip("/") + f"{PATH}/{row.id}/results"
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


@router.post(PATH)
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
    limit: int = 20,
    before_id: str | None = None,
    after_id: str | None = None,
) -> JSONResponse:
    state: BatchState = request.app.state.batches
    if not 1 <= limit <= 1000:
        raise APIError(400, "invalid_request", "limit: must be 1 to 1000", param="limit")
    rows, has_more = await state.db(
        state.store.list_batches, "anthropic", owner_of(request), limit, after_id, before_id
    )
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
