"""Server-Sent Events framing, and priming a stream so that errors before the first token
are still HTTP errors rather than events after a 200."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

T = TypeVar("T")


def sse_event(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


async def prime(stream: AsyncIterator[T]) -> tuple[T | None, AsyncIterator[T]]:
    """Take the first item now (raising its errors here); return it with the rest."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        return None, stream
    return first, stream
