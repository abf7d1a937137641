"""Per-group limits on interactive requests: how many run at once, requests per minute and
tokens per minute, with the rate-limit headers each API's clients read.

Accounting (OpenAI's way): each engine request is charged its prompt tokens plus its
`max_tokens` when it is submitted, and nothing is given back when it ends early; `n`
choices are `n` engine requests. Requests per minute and concurrency count API requests.
The limits are token buckets that refill continuously (a full minute's allowance at most).
A refused request gets a 429 (both APIs) with `retry-after`, before it reaches the engine.
Batch requests are not limited here (their quotas are the batch store's).

RateLimiter keeps the limits in this gateway's memory; SharedRateLimiter (shared_limits.py)
keeps them in the batch store, for every gateway sharing it. The gateway calls either
through `Limiter`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from fastapi.responses import JSONResponse
from starlette.requests import Request

from tokenfleet.server.errors import (
    APIError,
    anthropic_error_body,
    is_anthropic_request,
    request_id,
    request_id_headers,
)


@dataclass(frozen=True)
class GroupLimits:
    """Each key group's limits on interactive requests; 0 turns one off."""

    max_concurrent: int = 64
    requests_per_minute: int = 1200
    tokens_per_minute: int = 2_000_000

    def __post_init__(self) -> None:
        if min(self.max_concurrent, self.requests_per_minute, self.tokens_per_minute) < 0:
            raise ValueError("rate limits must be positive, or 0 for none")


class Bucket:
    """`per_minute` units a minute, refilled continuously, a minute's worth at most; full
    at `now` unless `level` is given."""

    def __init__(self, per_minute: int, now: float, level: float | None = None) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity if level is None else level
        self.at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def take(self, amount: int, now: float) -> float:
        """Take `amount` and return 0, or take nothing and return the seconds until it
        could be taken (inf: more than the bucket ever holds)."""
        self._refill(now)
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate

    def remaining(self, now: float) -> int:
        self._refill(now)
        return int(self.level)

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self._refill(now)
        return (self.capacity - self.level) / self.rate


class RateLimited(APIError):
    """A 429 for a group over one of its limits (`which`: requests or tokens)."""

    def __init__(self, message: str, retry_after_s: float, which: str) -> None:
        super().__init__(429, "overloaded", message, retry_after_s=max(1, math.ceil(retry_after_s)))
        self.which = which


def over_concurrency(num_running: int, limit: int) -> RateLimited:
    return RateLimited(
        f"rate limited: {num_running} requests of this key group are running, its "
        f"limit is {limit} at once; retry when one has ended",
        1.0,
        "requests",
    )


def over_requests(limit: int, wait_s: float) -> RateLimited:
    return RateLimited(
        f"rate limited: over this key group's {limit} requests per minute", wait_s, "requests"
    )


def over_tokens(tokens: int, limit: int, wait_s: float) -> RateLimited:
    """`wait_s` inf: more than the bucket ever holds."""
    if wait_s == math.inf:
        return RateLimited(
            f"rate limited: this request needs {tokens} tokens (prompt plus max_tokens), "
            f"over this key group's limit of {limit} tokens per minute; lower max_tokens",
            60.0,
            "tokens",
        )
    return RateLimited(
        f"rate limited: this request needs {tokens} tokens (prompt plus max_tokens), "
        f"over what is left of this key group's {limit} tokens per minute",
        wait_s,
        "tokens",
    )


class Limiter(Protocol):
    """What the gateway calls, on its event loop: RateLimiter (this gateway's limits) or
    SharedRateLimiter (the store's, for every gateway sharing it)."""

    async def admit(self, group: str) -> None:
        """`enter`: RateLimited, or the caller must `release` once the request ends."""

    def release(self, group: str) -> None:
        """`leave`, without waiting for it."""

    async def charge(self, group: str, tokens: int) -> None:
        """`charge_tokens`."""

    def headers(self, group: str, anthropic: bool) -> list[tuple[bytes, bytes]]:
        """The rate-limit headers of a reply to `group`; never waits."""


class _Group:
    def __init__(self, limits: GroupLimits, now: float) -> None:
        self.running = 0
        self.requests = Bucket(limits.requests_per_minute, now)
        self.tokens = Bucket(limits.tokens_per_minute, now)


class RateLimiter:
    """The limits of every group, on the gateway's event loop (no locks)."""

    def __init__(self, limits: GroupLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._groups: dict[str, _Group] = {}

    def _group(self, group: str) -> _Group:
        found = self._groups.get(group)
        if found is None:
            found = self._groups[group] = _Group(self.limits, self.clock())
        return found

    def enter(self, group: str) -> None:
        """An interactive API request starts: RateLimited over the group's concurrency or
        requests per minute; else the caller must call `leave` once it ends."""
        g, now, limits = self._group(group), self.clock(), self.limits
        if limits.max_concurrent and g.running >= limits.max_concurrent:
            raise over_concurrency(g.running, limits.max_concurrent)
        if limits.requests_per_minute:
            wait = g.requests.take(1, now)
            if wait:
                raise over_requests(limits.requests_per_minute, wait)
        g.running += 1

    def leave(self, group: str) -> None:
        self._group(group).running -= 1

    def num_running(self, group: str) -> int:
        found = self._groups.get(group)
        return 0 if found is None else found.running

    def charge_tokens(self, group: str, tokens: int) -> None:
        """An engine request of `tokens` (prompt + max_tokens): RateLimited if the group's
        tokens per minute cannot cover it now."""
        limit = self.limits.tokens_per_minute
        if not limit:
            return
        wait = self._group(group).tokens.take(tokens, self.clock())
        if wait:
            raise over_tokens(tokens, limit, wait)

    def headers(self, group: str, anthropic: bool) -> list[tuple[bytes, bytes]]:
        """The rate-limit headers of a reply to `group`, in the API's own names."""
        g, limits = self._group(group), self.limits
        buckets = (
            ("requests", g.requests, limits.requests_per_minute),
            ("tokens", g.tokens, limits.tokens_per_minute),
        )
        return rate_limit_headers(buckets, self.clock(), anthropic)

    # The gateway's calls (Limiter): nothing here waits.

    async def admit(self, group: str) -> None:
        self.enter(group)

    def release(self, group: str) -> None:
        self.leave(group)

    async def charge(self, group: str, tokens: int) -> None:
        self.charge_tokens(group, tokens)


def rate_limit_headers(
    buckets: Sequence[tuple[str, Bucket, int]], now: float, anthropic: bool
) -> list[tuple[bytes, bytes]]:
    """The headers of (name, bucket, limit) for each limit that is on (limit not 0), in the
    API's own names."""
    wall = time.time()
    out: list[tuple[str, str]] = []
    for name, bucket, limit in buckets:
        if not limit:
            continue
        remaining, reset = str(bucket.remaining(now)), bucket.reset_s(now)
        if anthropic:
            at = datetime.fromtimestamp(math.ceil(wall + reset), UTC)
            out += [
                (f"anthropic-ratelimit-{name}-limit", str(limit)),
                (f"anthropic-ratelimit-{name}-remaining", remaining),
                (f"anthropic-ratelimit-{name}-reset", at.strftime("%Y-%m-%dT%H:%M:%SZ")),
            ]
        else:
            out += [
                (f"x-ratelimit-limit-{name}", str(limit)),
                (f"x-ratelimit-remaining-{name}", remaining),
                (f"x-ratelimit-reset-{name}", go_duration(reset)),
            ]
    return [(k.encode(), v.encode()) for k, v in out]


def go_duration(seconds: float) -> str:
    """OpenAI's reset format: "0s", "12ms", "1.5s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


def rate_limited_response(request: Request, error: RateLimited) -> JSONResponse:
    """A 429 in the API's format: Anthropic's rate_limit_error, OpenAI's
    rate_limit_exceeded (type `requests` or `tokens`, as OpenAI sends)."""
    rid = request_id(request)
    headers = request_id_headers(rid) | {"retry-after": str(error.retry_after_s)}
    body: dict[str, Any]
    if is_anthropic_request(request):
        body = anthropic_error_body("rate_limit", error.message, rid)
    else:
        body = {
            "error": {
                "message": error.message,
                "type": error.which,
                "param": None,
                "code": "rate_limit_exceeded",
            }
        }
    return JSONResponse(body, status_code=429, headers=headers)
