"""Request bodies and the checks of each API's error format that several test modules
share, and a raw HTTP exchange for bytes an HTTP client would not send."""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import httpx

from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer

USER = [{"role": "user", "content": "Hi"}]


def post_json(
    server: LiveServer, path: str, body: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    """POST `body` (JSON-encoded unless already bytes) with `headers` over the JSON type."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=sent, timeout=HTTP_TIMEOUT_S)


def nested(depth: int) -> Any:
    """A JSON value nested `depth` objects deep."""
    value: Any = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


def chat(**fields: Any) -> dict[str, Any]:
    """An OpenAI chat body of one token, with `fields` over it."""
    return {"model": MODEL, "messages": USER, "max_tokens": 1, **fields}


def cmpl(**fields: Any) -> dict[str, Any]:
    """An OpenAI completions body of one token, with `fields` over it."""
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields}


def assert_openai_400(response: httpx.Response, param: str | None) -> dict[str, Any]:
    """A 400 in OpenAI's format naming `param`; its error object."""
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    return error


def assert_anthropic_400(response: httpx.Response, field: str) -> None:
    """A 400 in Anthropic's format whose message names `field`, with the request id."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert (body["type"], body["error"]["type"]) == ("error", "invalid_request_error")
    assert field in body["error"]["message"], body
    assert body["request_id"] == response.headers["request-id"]


def raw_exchange(server: LiveServer, request: bytes) -> tuple[int, bytes]:
    """Send raw bytes; the reply's status and body (the server closes or answers once)."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S) as s:
        s.sendall(request)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _length(reply: bytes) -> int:
    match = re.search(rb"content-length: (\d+)", reply.split(b"\r\n\r\n", 1)[0], re.I)
    return int(match.group(1)) if match else 0
