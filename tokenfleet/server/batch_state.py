"""What the Batch API routes share: the store, the dispatcher, the file folder, the
caller's identity, and bounded-memory reading of large bodies."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, TypeVar, cast

from fastapi import Request

from tokenfleet.batch.schema import BatchRow, FileRow, NewBatch, NewRequest, ResultRow
from tokenfleet.batch.store import BatchStore, QuotaExceeded
from tokenfleet.server.body import limited_chunks
from tokenfleet.server.dispatcher import BatchDispatcher
from tokenfleet.server.errors import APIError
from tokenfleet.server.keys import Owners, owner_id
from tokenfleet.server.settings import BatchConfig

T = TypeVar("T")

SPOOL_IN_MEMORY = 1 << 20  # bodies larger than this go to a temporary file
RESULTS_CHUNK = 1000
QUOTA_RETRY_AFTER_S = 60  # a caller over its queued-requests quota: try again after this


class BatchState:
    """Held on app.state.batches for the routes."""

    def __init__(
        self,
        config: BatchConfig,
        store: BatchStore,
        dispatcher: BatchDispatcher,
        clock: Callable[[], float] = time.time,
        owners: Owners | None = None,
    ) -> None:
        self.config = config
        # The routes' view of the store: creates count against the caller's key group's
        # quotas of queued requests and stored file bytes (a 429 over either).
        quota = QuotaStore(store, config, owners or Owners(()))
        self.store: BatchStore = cast(BatchStore, quota)
        self.dispatcher = dispatcher
        self.clock = clock
        self._routes_db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-routes")
        config.files_dir.mkdir(parents=True, exist_ok=True)

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """A store call for a route, on the routes' own store thread: a caller's create or
        look-up does not queue behind the dispatcher's leases and commits (another key's
        large job keeps those busy)."""
        return await asyncio.get_running_loop().run_in_executor(self._routes_db, fn, *args)

    async def iter_results(self, batch_id: str) -> AsyncIterator[list[ResultRow]]:
        """A batch's results in order, a chunk at a time, never all in memory."""
        rows = await self.db(self.store.iter_results, batch_id, RESULTS_CHUNK)

        def take() -> list[ResultRow]:
            return [row for _, row in zip(range(RESULTS_CHUNK), rows, strict=False)]

        while chunk := await self.db(take):
            yield chunk


class QuotaStore:
    """A BatchStore whose create_batch() and create_file() hold each key group to the
    config's quotas (requests waiting to run, stored file bytes), refusing a create over
    one with a 429 in the API's format."""

    def __init__(self, store: BatchStore, config: BatchConfig, owners: Owners) -> None:
        self._store = store
        self._config = config
        self._owners = owners

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def create_batch(self, batch: NewBatch, requests: Iterable[NewRequest]) -> BatchRow:
        quota = self._config.max_queued_per_key
        try:
            return self._store.create_batch(
                batch, requests, quota, self._owners.members(batch.owner)
            )
        except QuotaExceeded as exc:
            raise APIError(429, "rate_limit", str(exc), retry_after_s=QUOTA_RETRY_AFTER_S) from exc

    def create_file(self, file: FileRow) -> None:
        quota = self._config.max_file_bytes_per_key
        try:
            self._store.create_file(file, quota, self._owners.members(file.owner))
        except QuotaExceeded as exc:
            raise APIError(429, "rate_limit", str(exc)) from exc


def owner_of(request: Request) -> str:
    """Who owns what this call creates or may see: a digest of its API key ("" when the
    server runs without keys)."""
    key = request.scope.get("tokenfleet.api_key")
    return owner_id(str(key) if key else None)


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
