"""Deadlines on reading a request, so that half-sent connections are closed: uvicorn's
HTTP protocol (httptools) with a deadline on the request line and headers (from the
connection's start, or the next request's first byte on a kept-alive one), a deadline on
each pause in the body, and a bound on the headers' size (431 above it).

uvicorn itself closes only idle kept-alive connections (timeout_keep_alive); a connection
that sends half its headers, or half its body, would be held forever.
"""

from __future__ import annotations

import asyncio
import json
import resource
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True)
class ReadDeadlines:
    header_timeout_s: float = 10.0  # request line and headers, whole
    body_timeout_s: float = 30.0  # the longest pause between two parts of a body
    max_header_bytes: int = 64 * 1024  # request line and headers together


def _refusal(status: bytes, url: bytes, message: str) -> bytes:
    """An HTTP error the parser gives, with a JSON body in the format of the API the URL
    names (it may be partial)."""
    error: dict[str, Any]
    if url.startswith(b"/v1/messages"):
        error = {"type": "invalid_request_error", "message": message}
        body = json.dumps({"type": "error", "error": error}).encode()
    else:
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        body = json.dumps({"error": error}).encode()
    head = b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
    return head + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def protocol_class(deadlines: ReadDeadlines) -> type[asyncio.Protocol]:
    """The HTTP protocol class to give uvicorn.Config(http=...)."""

    class DeadlineProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None
            self._header_bytes = 0
            self._too_large = False

        def _arm(self, seconds: float, body: bool) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired, body)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self, body: bool) -> None:
            self._timer = None
            if body and self.flow is not None and self.flow.read_paused:
                # The server stopped reading (the app has not taken the body yet): not
                # the client's pause.
                self._arm(deadlines.body_timeout_s, body)
                return
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(deadlines.header_timeout_s, False)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            self._arm(deadlines.header_timeout_s, False)

        def _count(self, size: int) -> None:
            self._header_bytes += size
            if self._header_bytes > deadlines.max_header_bytes:
                self._too_large = True
                raise ValueError("request line and headers too large")

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._arm(deadlines.body_timeout_s, True)
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._arm(deadlines.body_timeout_s, True)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            # A request the HTTP parser refused (bytes no header may hold, a broken request
            # line) or headers over the bound: in the API's error format, never a 500.
            self._disarm()
            url = self.url if isinstance(getattr(self, "url", None), bytes) else b""
            if self._too_large:
                limit = deadlines.max_header_bytes
                reply = _refusal(
                    b"431 Request Header Fields Too Large",
                    url,
                    f"request line and headers are over {limit} bytes",
                )
            else:
                reply = _refusal(
                    b"400 Bad Request",
                    url,
                    "malformed HTTP request: the request line or a header holds bytes HTTP "
                    "does not allow there",
                )
            self.transport.write(reply)
            self.transport.close()

    return DeadlineProtocol


def raise_open_files_limit(max_connections: int) -> None:
    """Let the process hold --max-connections sockets and its own files: the soft limit
    on open files raised toward the hard one (uvicorn answers 503 past max_connections;
    past the open-files limit, accept() would fail instead)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections * 2 + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
