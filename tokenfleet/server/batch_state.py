"""What the Batch API routes share: the store, the dispatcher, the file folder, the
caller's identity, and bounded-memory reading of large bodies."""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import IO, Any, TypeVar

from fastapi import Request

from tokenfleet.batch.schema import ResultRow
from tokenfleet.batch.store import BatchStore
from tokenfleet.server.body import limited_chunks
from tokenfleet.server.dispatcher import BatchDispatcher
from tokenfleet.server.settings import BatchConfig

T = TypeVar("T")

SPOOL_IN_MEMORY = 1 << 20  # bodies larger than this go to a temporary file
RESULTS_CHUNK = 1000


class BatchState:
    """Held on app.state.batches for the routes."""

    def __init__(
        self,
        config: BatchConfig,
        store: BatchStore,
        dispatcher: BatchDispatcher,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.dispatcher = dispatcher
        self.clock = clock
        config.files_dir.mkdir(parents=True, exist_ok=True)

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.dispatcher.db(fn, *args)

    async def iter_results(self, batch_id: str) -> AsyncIterator[list[ResultRow]]:
        """A batch's results in order, a chunk at a time, never all in memory."""
        rows = await self.db(self.store.iter_results, batch_id, RESULTS_CHUNK)

        def take() -> list[ResultRow]:
            return [row for _, row in zip(range(RESULTS_CHUNK), rows, strict=False)]

        while chunk := await self.db(take):
            yield chunk


def owner_of(request: Request) -> str:
    """Who owns what this call creates or may see: a digest of its API key ("" when the
    server runs without keys)."""
    key = request.scope.get("tokenfleet.api_key")
    if not key:
        return ""
    return hashlib.sha256(str(key).encode()).hexdigest()[:32]


async def spool_body(request: Request, limit: int) -> IO[bytes]:
    """The request body in a (spooled) temporary file, refused with 413 past `limit`."""
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)  # noqa: SIM115 (returned)
    try:
        async for chunk in limited_chunks(request, limit):
            spool.write(chunk)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return spool  # type: ignore[return-value]
