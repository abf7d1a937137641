"""Server-Sent Events framing, and priming a stream so that errors before the first token
are still HTTP errors rather than events after a 200."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

T = TypeVar("T")


def sse_event(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


async def prime(stream: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Take the first item now, so that its errors are raised here, before any 200; return
    a stream of all items, first included, that closes `stream` when it is closed."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None

    async def everything() -> AsyncGenerator[T, None]:
        async with contextlib.aclosing(stream):
            if first is not None:
                yield first
                async for item in stream:
                    yield item

    return everything()
