"""What the gateway does to a request before its route and around its reply: the key
(and its group), the operator key for /metrics and admin routes, the group's limits, large
bodies checked off the event loop, the rate-limit headers, and a stall deadline on streams.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import MutableHeaders
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Message, Receive, Send

from tokenfleet.server.body import whole_body
from tokenfleet.server.errors import APIError, error_response
from tokenfleet.server.keys import ANONYMOUS_GROUP, KeyRing, own_group
from tokenfleet.server.limits import Limiter, RateLimited, rate_limited_response
from tokenfleet.server.metrics import Metrics
from tokenfleet.server.offload import PRECHECKS, Offloader, replayed_receive, replaying
from tokenfleet.server.service import GenerationService
from tokenfleet.server.settings import ServeConfig

# Open to anyone: load balancers' liveness and readiness probes.
OPEN_PATHS = ("/health", "/health/live", "/health/ready")
# The operator's: need the operator key once any key is set.
OPERATOR_PATHS = ("/metrics",)
ADMIN_PREFIX = "/admin/"


class StreamStalled(OSError):
    """A stream's reader fell behind past the stall deadline (EventStream ends on it as
    on a disconnect, closing its events and so aborting the engine request)."""


class Gate:
    def __init__(self, config: ServeConfig, service: GenerationService, metrics: Metrics) -> None:
        self.config = config
        groups = dict(config.key_groups)
        groups.update({k: own_group(k) for k in config.api_keys if k not in groups})
        self.keys = KeyRing(groups, config.operator_key)
        self.operator_required = bool(config.api_keys) or config.operator_key is not None
        self.service = service
        self.metrics = metrics
        self.offloader = Offloader(config.check_threads, metrics.prechecks_running.set)

    @property
    def limiter(self) -> Limiter:
        """The service's: this gateway's own, or the store's once it is open (app.py)."""
        return self.service.limiter

    def authorize(self, request: Request) -> tuple[APIError | None, str | None]:
        """(a 401, or None) and the caller's group (None without keys). A caller's key is
        put on the scope: batches and files belong to their key."""
        scope, path = request.scope, request.scope["path"]
        if path in OPEN_PATHS:
            return None, None
        if path in OPERATOR_PATHS or path.startswith(ADMIN_PREFIX):
            if self.operator_required and not self.keys.is_operator(scope):
                return APIError(401, "authentication", "missing or invalid operator key"), None
            return None, None
        if not self.keys.enabled:
            return None, None
        found = self.keys.caller(scope)
        if found is None:
            return APIError(401, "authentication", "missing or invalid API key"), None
        scope["tokenfleet.api_key"], group = found
        return None, group

    async def enter(self, request: Request, group: str | None) -> Response | None:
        """An interactive request starts: a 429 over its group's concurrency or requests
        per minute, else None (and `leave` once it ends)."""
        try:
            await self.limiter.admit(group or ANONYMOUS_GROUP)
        except RateLimited as exc:
            return self.refused(request, exc, group)
        return None

    def leave(self, group: str | None) -> None:
        self.limiter.release(group or ANONYMOUS_GROUP)

    def refused(self, request: Request, error: RateLimited, group: str | None) -> Response:
        self.metrics.rate_limited.labels(error.which).inc()
        return rate_limited_response(request, error)  # wrap_send adds the group's headers

    async def precheck(self, request: Request) -> tuple[Receive, Response | None]:
        """For a route that tokenizes: read its body (before the group's limits are taken,
        so that a half-sent body holds none of them), and check a large one off the loop.
        The receive the route should read the body from, and the reply if refused."""
        scope, receive = request.scope, request.receive
        if scope["method"] != "POST" or scope["path"] not in PRECHECKS:
            return receive, None
        try:
            body = await whole_body(request, self.config.max_body_bytes)
        except APIError as exc:
            return receive, error_response(request, exc)
        except ClientDisconnect:
            return receive, Response(status_code=499)
        replayed = replayed_receive(body, receive)
        if len(body) <= self.config.offload_body_bytes:
            return replayed, None
        try:
            memo = await self.offloader.precheck(scope["path"], self.service, body)
        except APIError as exc:
            return replayed, error_response(request, exc)
        if memo is not None:
            replaying(memo)
        return replayed, None

    def wrap_send(self, send: Send, group: str | None, anthropic: bool) -> Send:
        """`send` with the group's rate-limit headers on the reply, and a deadline on each
        part of a stream: past it (the reader fell behind and the send buffer stayed full),
        StreamStalled ends the stream."""
        stall_s = self.config.stream_stall_timeout_s
        limiter = self.limiter
        name = group or ANONYMOUS_GROUP

        async def limited_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for key, value in limiter.headers(name, anthropic):
                    headers.append(key.decode(), value.decode())
                await send(message)
            elif message.get("more_body", False):
                try:
                    async with asyncio.timeout(stall_s):
                        await send(message)
                except TimeoutError:
                    self.metrics.streams_stalled.inc()
                    raise StreamStalled("the stream's reader fell behind") from None
            else:
                await send(message)

        return limited_send
