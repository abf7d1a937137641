"""Reading a request body: the size limit, JSON, and pydantic validation, each failure
a 4xx that names what is wrong."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

import msgspec
from fastapi import Request
from pydantic import BaseModel, ValidationError

from tokenfleet.server.errors import APIError

M = TypeVar("M", bound=BaseModel)


async def limited_chunks(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; 413 as soon as it is (or declares to be) over
    `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, "request_too_large", f"request body of {declared} bytes exceeds {limit}"
        )
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, "request_too_large", f"request body exceeds {limit} bytes")
        yield chunk


async def read_body(request: Request, model: type[M]) -> M:
    limit = request.app.state.config.max_body_bytes
    chunks = [chunk async for chunk in limited_chunks(request, limit)]
    try:
        data = msgspec.json.decode(b"".join(chunks))
    except msgspec.DecodeError as exc:
        raise APIError(400, "invalid_request", f"malformed JSON body: {exc}") from exc
    return parse_body(data, model)


def parse_body(data: object, model: type[M]) -> M:
    """Validate decoded JSON against a request model; the first error names its field.
    (The Batch API checks each of its requests' params with this too.)"""
    if not isinstance(data, dict):
        raise APIError(400, "invalid_request", "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise APIError(400, "invalid_request", f"{field}: {first['msg']}", param=field) from exc
