"""The dispatcher's attempts and store faults, on a real SQLite store with the requests run
by a function in place of the engine (marker `fake("engine")`):

- an engine that dies while a request runs counts an attempt; at max attempts the request
  ends errored with an error object that says why, in both APIs' result formats;
- an engine that was down before the request reached it, and a gateway that stops while
  the request runs, count none: such a request runs again and succeeds;
- the real SQLite locked by another connection (its writes fail with "database is
  locked"): the loops that lease and commit retry with backoff, never end, and every
  request still ends with exactly one result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select

from tokenfleet.batch.schema import NewBatch, NewRequest, batch_requests
from tokenfleet.batch.store import BatchStore
from tokenfleet.engine.client import EngineDeadError
from tokenfleet.server.dispatcher import BatchDispatcher, DispatcherConfig, ResultFormats
from tokenfleet.server.errors import APIError

pytestmark = pytest.mark.fake("engine")

ENDPOINTS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}


def create(store: BatchStore, batch_id: str, api: str, custom_ids: list[str]) -> None:
    now = time.time()
    store.create_batch(
        NewBatch(batch_id, api, "alice", ENDPOINTS[api], now, now + 3600),  # type: ignore[arg-type]
        (NewRequest(c, json.dumps({"custom_id": c})) for c in custom_ids),
    )


def rows(store: BatchStore, batch_id: str) -> dict[str, Any]:
    with store.engine.connect() as conn:
        found = conn.execute(
            select(batch_requests).where(batch_requests.c.batch_id == batch_id)
        ).all()
    return {r.custom_id: r for r in found}


async def until(condition: Callable[[], Any], timeout_s: float = 60) -> None:
    """Polls; the bound only catches a hang."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.01)


def dispatcher(store: BatchStore, runner: Any, **config: Any) -> BatchDispatcher:
    return BatchDispatcher(
        store,
        DispatcherConfig(owner="g", poll_s=0.005, maintenance_s=0.05, **config),
        {path: runner for path in ENDPOINTS.values()},
        ResultFormats(),
    )


def ended(store: BatchStore, batch_id: str) -> bool:
    batch = store.get_batch_any_owner(batch_id)
    return batch is not None and batch.state == "ended"


def test_engine_deaths_count_attempts_and_say_why_in_both_formats_on_a_fake_engine(
    tmp_path: Path,
) -> None:
    store = BatchStore(f"sqlite:///{tmp_path / 'batches.db'}")
    calls: dict[str, int] = {}

    async def runner(params: dict[str, Any]) -> dict[str, Any]:
        custom_id = params["custom_id"]
        calls[custom_id] = calls.get(custom_id, 0) + 1
        if custom_id == "poison":  # its engine dies under it every time
            try:
                raise EngineDeadError("the engine process exited (SIGKILL)")
            except EngineDeadError as exc:
                raise APIError(503, "engine_down", str(exc)) from exc
        if (
            custom_id.startswith("early") and calls[custom_id] <= 5
        ):  # the engine was down: not its fault
            raise APIError(503, "engine_down", "the engine is not running; try again shortly")
        return {"echo": custom_id}

    async def go() -> None:
        running = dispatcher(store, runner, max_attempts=3)
        await running.start()
        try:
            for api in ("anthropic", "openai"):
                create(store, f"batch_{api}", api, ["ok", "poison", f"early-{api}"])
            running.wake()
            await until(lambda: ended(store, "batch_anthropic") and ended(store, "batch_openai"))
        finally:
            await running.stop()

    asyncio.run(go())
    for api in ("anthropic", "openai"):
        found = rows(store, f"batch_{api}")
        assert {c: (r.status, r.failures) for c, r in found.items()} == {
            "ok": ("succeeded", 0),
            "poison": ("errored", 3),
            f"early-{api}": ("succeeded", 0),
        }
        assert found["poison"].attempts == 3 and found[f"early-{api}"].attempts == 6
        result = json.loads(found["poison"].result)
        if api == "anthropic":
            assert result["type"] == "errored"
            error = result["error"]["error"]
            assert error["type"] == "api_error"
        else:
            assert result["status_code"] == 503
            error = result["body"]["error"]
            assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
        assert "on each of its 3 attempts" in error["message"], error
        assert "SIGKILL" in error["message"], error
    assert calls["poison"] == 6


def test_a_locked_sqlite_store_delays_commits_and_never_ends_the_loops_on_a_fake_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another connection holds SQLite's write lock for a while: the store's writes fail
    ("database is locked", after a busy timeout cut to 20 ms here) while results are
    waiting to be committed. They are committed once the lock goes; nothing is lost or
    doubled, and a batch created afterwards still runs."""
    path = tmp_path / "batches.db"
    store = BatchStore(f"sqlite:///{path}")

    @event.listens_for(store.engine, "connect")
    def short_busy_timeout(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.execute("PRAGMA busy_timeout = 20")

    store.engine.dispose()  # connections from now on wait 20 ms for the lock, not 30 s
    go_on = asyncio.Event()

    async def runner(params: dict[str, Any]) -> dict[str, Any]:
        await go_on.wait()
        return {"echo": params["custom_id"]}

    caplog.set_level(logging.ERROR, logger="tokenfleet.server.dispatcher")

    def commit_failures() -> int:
        return sum("committing" in r.getMessage() for r in caplog.records)

    async def go() -> None:
        running = dispatcher(store, runner, retry_s=0.01, retry_max_s=0.2)
        await running.start()
        try:
            create(store, "batch_1", "anthropic", [f"r{i}" for i in range(20)])
            running.wake()
            await until(lambda: running.num_in_flight == 8)  # leased, running
            locker = sqlite3.connect(path, isolation_level=None)
            locker.execute("BEGIN IMMEDIATE")  # the write lock, held
            go_on.set()  # results now arrive while no write can go through
            await until(lambda: commit_failures() >= 5)
            assert store.request_counts("batch_1")["leased"] == 8  # none committed (a read)
            locker.execute("COMMIT")
            locker.close()
            await until(lambda: ended(store, "batch_1"))
            create(store, "batch_2", "openai", ["later"])  # the loops still run
            running.wake()
            await until(lambda: ended(store, "batch_2"))
        finally:
            await running.stop()

    asyncio.run(go())
    assert commit_failures() >= 5
    assert {r.status for r in rows(store, "batch_1").values()} == {"succeeded"}
    assert store.request_counts("batch_1")["succeeded"] == 20
    assert all(r.attempts == 1 for r in rows(store, "batch_1").values())
    assert rows(store, "batch_2")["later"].status == "succeeded"
