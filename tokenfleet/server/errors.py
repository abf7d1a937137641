"""API errors and their two wire formats.

One APIError carries a status and a kind; the route's flavor decides the body:

    Anthropic: {"type": "error", "error": {"type": "...", "message": "..."}, "request_id": ...}
    OpenAI:    {"error": {"message": "...", "type": "...", "param": ..., "code": ...}}

Every response carries the request's id in the header each API's clients read: `request-id`
(Anthropic) and `x-request-id` (OpenAI); both go out on every response.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenfleet.server.ids import random_hex

# kind -> (Anthropic error type, OpenAI error type, OpenAI code)
_KINDS: dict[str, tuple[str, str, str | None]] = {
    "invalid_request": ("invalid_request_error", "invalid_request_error", None),
    # a prompt plus max_tokens over the context: OpenAI's own code for it
    "context_length": ("invalid_request_error", "invalid_request_error", "context_length_exceeded"),
    "authentication": ("authentication_error", "invalid_request_error", "invalid_api_key"),
    "not_found": ("not_found_error", "invalid_request_error", "model_not_found"),
    "request_too_large": ("request_too_large", "invalid_request_error", "request_too_large"),
    "overloaded": ("overloaded_error", "server_error", "overloaded"),
    # a 429 for a quota (queued batch requests, stored file bytes): retry later or free some
    "rate_limit": ("rate_limit_error", "requests", "rate_limit_exceeded"),
    "engine_down": ("api_error", "server_error", "engine_unavailable"),
    "internal": ("api_error", "server_error", None),
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        assert kind in _KINDS
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s


def is_anthropic_request(request: Request) -> bool:
    """Whether to answer in Anthropic's format: its routes, and the routes both APIs share
    (/v1/models) when the client sends Anthropic's version header (its SDK always does)."""
    path = request.url.path
    if path.startswith("/v1/messages"):
        return True
    return path.startswith("/v1/models") and "anthropic-version" in request.headers


def anthropic_error_body(kind: str, message: str, rid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": _KINDS[kind][0], "message": message}}
    if rid is not None:
        body["request_id"] = rid
    return body


def openai_error_body(kind: str, message: str, param: str | None) -> dict[str, Any]:
    _, error_type, code = _KINDS[kind]
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def request_id(request: Request) -> str:
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = f"req_{random_hex(24)}"
        request.state.request_id = rid
    return str(rid)


REQUEST_ID_HEADERS = ("request-id", "x-request-id")  # Anthropic's, OpenAI's


def request_id_headers(rid: str) -> dict[str, str]:
    return dict.fromkeys(REQUEST_ID_HEADERS, rid)


def error_response(request: Request, error: APIError) -> JSONResponse:
    rid = request_id(request)
    headers = request_id_headers(rid)
    if error.retry_after_s is not None:
        headers["retry-after"] = str(error.retry_after_s)
    status = error.status
    if is_anthropic_request(request):
        body = anthropic_error_body(error.kind, error.message, rid)
    else:
        body = openai_error_body(error.kind, error.message, error.param)
        if error.kind == "overloaded":
            status = 429  # OpenAI clients back off and retry on 429 + Retry-After
    return JSONResponse(body, status_code=status, headers=headers)


def _field_name(loc: tuple[Any, ...]) -> str:
    """A validation error's location as the API names a field ("messages.0.content"),
    without pydantic's union-branch tags ("str", "list[int]", "function-after[...]")."""
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or not (p in _TYPE_TAGS or "[" in str(p) or "-" in str(p))
    ]
    return ".".join(parts)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_error(errors: list[Any], *, skip: int = 0) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors as a 400 naming its field;
    `skip`: leading parts of the location to drop (FastAPI's "query", "path", "body")."""
    # Of a union's errors, the branch the value had the type of ("stop.0: too long"),
    # rather than "not a string" from the branch it was not meant for.
    typed = [e for e in errors if not str(e.get("type", "")).endswith(("_type", "is_instance_of"))]
    first = (typed or errors or [{"loc": (), "msg": "invalid request"}])[0]
    field = _field_name(tuple(first.get("loc", ()))[skip:]) or "body"
    return APIError(400, "invalid_request", f"{field}: {first.get('msg')}", param=field)
