"""OpenAI Files: /v1/files (upload, list, retrieve, content, delete).

An uploaded file (purpose "batch") lives in the gateway's file folder under its id; a
batch's output and error files are rendered from the stored results (see
openai_result_files). Each file belongs to the key that made it: any other gets 404.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from tokenfleet.batch.schema import FileRow
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server import openai_result_files
from tokenfleet.server.batch_state import BatchState, owner_of
from tokenfleet.server.bounds import CURSOR_PATTERN, MAX_CURSOR_CHARS
from tokenfleet.server.errors import APIError
from tokenfleet.server.upload import receive_upload

router = APIRouter()
PATH = "/v1/files"
UPLOAD_PURPOSES = ("batch",)
MAX_LIST = 10_000


def file_object(row: FileRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": int(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": row.status,
        "expires_at": None,
        "status_details": None,
    }


def not_found(file_id: str, param: str = "file_id") -> APIError:
    # OpenAI's own answer for a missing file: 404, invalid_request_error, code null.
    return APIError(404, "invalid_request", f"No such File object: {file_id}", param=param)


async def get_file(state: BatchState, request: Request, file_id: str) -> FileRow:
    """The caller's file, or 404."""
    row = await state.db(state.store.get_file, file_id, owner_of(request))
    if row is None:
        raise not_found(file_id)
    return row


def uploaded_path(state: BatchState, row: FileRow) -> Path:
    return state.config.files_dir / row.location


UPLOAD_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
                    },
                    "required": ["file", "purpose"],
                }
            }
        },
    }
}


@router.post(PATH, openapi_extra=UPLOAD_SCHEMA)
async def upload_file(request: Request) -> JSONResponse:
    state: BatchState = request.app.state.batches
    file_id = f"file-{uuid.uuid4().hex[:24]}"
    path = state.config.files_dir / file_id
    upload = await receive_upload(request, path, state.config.max_batch_bytes, "file")
    try:
        purpose = upload.fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(
                400,
                "invalid_request",
                f"purpose: {purpose!r} is not supported; upload batch input with purpose 'batch'",
                param="purpose",
            )
        if upload.filename is None:
            raise APIError(400, "invalid_request", "file: a file part is required", param="file")
        row = FileRow(
            id=file_id,
            owner=owner_of(request),
            purpose=purpose,
            filename=upload.filename,
            bytes=upload.num_bytes,
            created_at=state.clock(),
            status="processed",
            location=file_id,  # under the file folder
        )
        await state.db(state.store.create_file, row)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return JSONResponse(file_object(row))


@router.get(PATH)
async def list_files(
    request: Request,
    purpose: str | None = Query(None, max_length=64),
    limit: int = Query(MAX_LIST, ge=1, le=MAX_LIST),
    after: str | None = Query(None, max_length=MAX_CURSOR_CHARS, pattern=CURSOR_PATTERN),
    order: str = Query("desc", max_length=8),
) -> JSONResponse:
    state: BatchState = request.app.state.batches
    if order != "desc":
        raise APIError(
            400, "invalid_request", "order: only 'desc' (newest first) is supported", param="order"
        )
    try:
        rows, has_more = await state.db(
            state.store.list_files, owner_of(request), purpose, limit, after
        )
    except InvalidRequestError as exc:
        raise APIError(400, "invalid_request", exc.message, param=exc.param) from exc
    return JSONResponse(
        {
            "object": "list",
            "data": [file_object(row) for row in rows],
            "first_id": rows[0].id if rows else None,
            "last_id": rows[-1].id if rows else None,
            "has_more": has_more,
        }
    )


@router.get(PATH + "/{file_id}")
async def retrieve_file(request: Request, file_id: str) -> JSONResponse:
    state: BatchState = request.app.state.batches
    return JSONResponse(file_object(await get_file(state, request, file_id)))


@router.get(PATH + "/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    state: BatchState = request.app.state.batches
    row = await get_file(state, request, file_id)
    result_file = openai_result_files.parse_location(row.location)
    if result_file is None:
        path = uploaded_path(state, row)
        if not path.is_file():
            raise APIError(404, "invalid_request", f"the content of {file_id} is gone")
        return FileResponse(path, media_type="application/octet-stream")
    batch_id, kind = result_file
    batch = await state.db(state.store.get_batch, batch_id, row.owner)
    if batch is None or batch.archived_at is not None:
        raise APIError(404, "invalid_request", f"the content of {file_id} is no longer kept")
    return StreamingResponse(
        openai_result_files.stream_lines(state, batch_id, kind),
        media_type="application/octet-stream",
    )


@router.delete(PATH + "/{file_id}")
async def delete_file(request: Request, file_id: str) -> JSONResponse:
    state: BatchState = request.app.state.batches
    row = await get_file(state, request, file_id)
    if not await state.db(state.store.delete_file, file_id, row.owner):
        raise not_found(file_id)
    if openai_result_files.parse_location(row.location) is None:
        await asyncio.to_thread(uploaded_path(state, row).unlink, missing_ok=True)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
