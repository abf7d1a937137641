"""Reading a request body: the size limit, JSON, and pydantic validation, each failure
a 4xx that names what is wrong."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

import msgspec
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from tokenfleet.server.bounds import MAX_JSON_DEPTH, check_json_depth
from tokenfleet.server.errors import APIError, validation_error

M = TypeVar("M", bound=BaseModel)


def _check_declared_size(request: Request, limit: int) -> None:
    """413 for a body that declares (Content-Length) to be over `limit` bytes."""
    for name, value in request.scope["headers"]:
        if name == b"content-length":
            declared = value.decode("latin-1")
            if declared.isdigit() and int(declared) > limit:
                raise APIError(
                    413, "request_too_large", f"request body of {declared} bytes exceeds {limit}"
                )
            return


def _check_size(size: int, limit: int) -> None:
    if size > limit:
        raise APIError(413, "request_too_large", f"request body exceeds {limit} bytes")


async def limited_chunks(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; 413 as soon as it is (or declares to be) over
    `limit` bytes."""
    _check_declared_size(request, limit)
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        _check_size(size, limit)
        yield chunk


async def whole_body(request: Request, limit: int) -> bytes:
    """The whole body, as limited_chunks() checks it, from the ASGI messages themselves: a
    small body is one message, read here without a stream (work every request of a burst
    does in turn before its own reaches the engine)."""
    _check_declared_size(request, limit)
    chunks = []
    size = 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        _check_size(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_body(request: Request, model: type[M]) -> M:
    body = await whole_body(request, request.app.state.config.max_body_bytes)
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise APIError(400, "invalid_request", f"malformed JSON body: {exc}") from exc
    except RecursionError as exc:
        message = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        raise APIError(400, "invalid_request", message) from exc
    return parse_body(data, model)


def parse_body(data: object, model: type[M]) -> M:
    """Validate decoded JSON against a request model; the first error names its field.
    (The Batch API checks each of its requests' params with this too.)"""
    if not isinstance(data, dict):
        raise APIError(400, "invalid_request", "the request body must be a JSON object")
    check_json_depth(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc
    except RecursionError as exc:  # (check_json_depth bounds it; this never should)
        raise APIError(400, "invalid_request", "JSON nested too deeply") from exc
