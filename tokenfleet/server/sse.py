"""Server-Sent Events: framing, the streamed response, and priming a stream so that errors
before the first token are still HTTP errors rather than events after a 200."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


_encode = msgspec.json.Encoder().encode


def sse_event(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One event: compact UTF-8 JSON (or a bare string such as [DONE]) on its data line."""
    payload = data.encode() if isinstance(data, str) else _encode(data)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + payload + b"\n\n"


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


class EventStream(Response):
    """A streamed text/event-stream reply that stops, and closes its events (which aborts
    the engine request), as soon as the client disconnects.

    Starlette's StreamingResponse does the same under uvicorn (ASGI 2.3) with an anyio task
    group of two tasks per response; here one watcher task cancels the streaming one. That
    is set-up work each stream of a burst does one after another on the event loop."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: Mapping[str, str] | None = None):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            streaming.cancel()

        watcher = asyncio.create_task(watch())
        events = self.events
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            streaming.uncancel()  # the client left: a normal end of this response
        except OSError:
            pass  # ASGI 2.4 servers raise this on a send after a disconnect
        finally:
            watcher.cancel()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
