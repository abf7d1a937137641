"""The chaos test's parts (tests/server/test_chaos.py): the store's faults, injected from
another connection in a thread, and gateways that take over from one another on one
store as the test SIGKILLs them."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import Engine, create_engine, make_url, text

from support.live_server import HTTP_TIMEOUT_S, LiveServer, live_server, wait_gone, wait_until
from tokenfleet.batch.store import engine_url

# What the gateways' store loops log when a store call failed and is retried.
RETRY_LOG = ("ERROR tokenfleet.server.dispatcher:", "; retrying")


# -- the store and its faults -------------------------------------------------------------


class StoreFaults:
    """Makes the store fail from another connection at seeded intervals, in a thread,
    until stopped; paused while a gateway starts."""

    def __init__(self, inject: Callable[[random.Random], None], seed: int) -> None:
        self.inject = inject
        self.rng = random.Random(seed)
        self.num_injected = 0
        self._stop = threading.Event()
        self._running = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="store-faults", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.rng.uniform(0.4, 1.2)):
                self._idle.clear()
                if self._running.is_set():
                    self.inject(self.rng)
                    self.num_injected += 1
                self._idle.set()
                self._running.wait()
        except BaseException as exc:  # told at stop()
            self.error = exc
        finally:
            self._idle.set()

    def start(self) -> None:
        self._running.set()
        self._thread.start()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._running.clear()
        self._idle.wait()  # the fault in progress is over
        try:
            yield
        finally:
            self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        assert self.error is None, f"the fault injector failed: {self.error!r}"


@dataclass
class Store:
    server_url: str  # the gateways' URL: short lock waits, connections the faults find
    reader: Engine  # the test's own connections: never the faults' target
    inject: Callable[[random.Random], None]  # one fault


def sqlite_store(tmp: Path) -> Store:
    """The fault: the write lock held for a moment."""
    path = tmp / "store" / "batches.db"
    path.parent.mkdir()

    def hold_write_lock(rng: random.Random) -> None:
        conn = sqlite3.connect(path, isolation_level=None, timeout=30)
        try:
            conn.execute("BEGIN IMMEDIATE")
            time.sleep(rng.uniform(0.1, 0.3))
            conn.execute("COMMIT")
        finally:
            conn.close()

    reader = create_engine(f"sqlite:///{path}")
    return Store(f"sqlite:///{path}?timeout=0.05", reader, hold_write_lock)


def postgres_store(url: str) -> Store:
    """The fault: the gateways' connections terminated (found by their application_name),
    or the requests table locked beyond their lock_timeout."""
    app = f"tokenfleet-chaos-{uuid.uuid4().hex[:8]}"
    parsed = make_url(url)
    options = f"{parsed.query['options']} -clock_timeout=100ms"
    server_url = parsed.update_query_dict({"options": options, "application_name": app})
    reader = create_engine(engine_url(url))

    def fail(rng: random.Random) -> None:
        if rng.random() < 0.5:
            with reader.connect() as conn:
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE application_name = :app"
                    ),
                    {"app": app},
                )
        else:
            with reader.begin() as conn:
                conn.execute(text("LOCK TABLE batch_requests IN ACCESS EXCLUSIVE MODE"))
                time.sleep(rng.uniform(0.1, 0.3))

    return Store(server_url.render_as_string(hide_password=False), reader, fail)


# -- the gateways ----------------------------------------------------------------------------


class Gateways:
    """One `tokenfleet serve` at a time on a shared store; the next one takes over when the
    test SIGKILLs the current gateway."""

    def __init__(self, tmp: Path, args: tuple[str, ...]) -> None:
        self.tmp = tmp
        self.args = args
        self.logs: list[Path] = []
        self._stack = contextlib.ExitStack()
        self.server: LiveServer | None = None
        self._killed: set[int] = set()  # engine pids: the gateway may not have seen one die

    def start(self, gateway_id: str) -> LiveServer:
        args = (*self.args, "--gateway-id", gateway_id)
        self.server = self._stack.enter_context(live_server(self.tmp, *args))
        self.logs.append(self.server.log)
        return self.server

    def engine_pid(self) -> int:
        """The pid of the current gateway's engine, once it is up (asked before the moment
        of a kill, so that the kill follows that moment closely)."""
        server = self.server
        assert server is not None

        def new_engine() -> int | None:
            # Until the gateway notices a kill, /health still names the killed engine; then
            # it is a 503 until the new one is up.
            health = httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT_S)
            if health.status_code != 200:
                return None
            pid = int(health.json()["engine_pid"])
            return None if pid in self._killed else pid

        return int(wait_until(new_engine, 60, "a new engine", every=0.02))

    def batch_in_engine(self) -> float:
        """Batch requests in the engine, running or waiting there, by the gateway's
        /metrics: an engine death fails each of them."""
        assert self.server is not None
        metrics = httpx.get(f"{self.server.url}/metrics", timeout=HTTP_TIMEOUT_S).text
        found = 0.0
        for line in metrics.splitlines():
            for state in ("running", "waiting"):
                if line.startswith(f'tokenfleet_num_requests_{state}_by_class{{class="batch"}} '):
                    found += float(line.split()[-1])
        return found

    def kill_engine(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self._killed.add(pid)
        assert wait_gone(pid, timeout=30), f"engine {pid} survived SIGKILL"

    def kill_gateway(self, engine_pid: int) -> None:
        """SIGKILL the gateway alone; its engine (`engine_pid`) must end with it."""
        assert self.server is not None
        os.kill(self.server.process.pid, signal.SIGKILL)
        self.server.process.wait(timeout=30)
        assert wait_gone(engine_pid, timeout=30), "the engine outlived its killed gateway"
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self.server = None

    def store_retries(self) -> int:
        """Store calls the gateways' loops saw fail and retried, by their logs."""
        lines = (line for log in self.logs for line in log.read_text().splitlines())
        return sum(all(part in line for part in RETRY_LOG) for line in lines)
