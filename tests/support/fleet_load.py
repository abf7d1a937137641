"""A steady load of streams against a live gateway and a watch over its fleet's replica
states, for the tests that scale a fleet under load (tests/cluster/test_fleet_scale_*.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai

from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer
from support.ray_cluster import fleet_rows

SETTLE_S = 120.0  # a bound that only a hang reaches


@dataclass
class StreamOutcome:
    label: Any  # what the load's `plan` named the stream by
    started_at: float  # time.monotonic()
    ended_at: float
    error: str | None  # repr of what the client raised (a 5xx raises)
    text: str
    finish_reasons: list[str]
    completion_tokens: int | None  # from the usage chunk


# (worker, its stream count so far) -> (label, the chat completion's keyword arguments
# besides model and stream)
Plan = Callable[[int, int], tuple[Any, dict[str, Any]]]


class StreamLoad:
    """`num_workers` threads, each running one stream after another (official `openai`
    client, chat completions with usage) until stopped, as `plan` says; every outcome
    kept, in the order they ended."""

    def __init__(self, server: LiveServer, num_workers: int, plan: Plan) -> None:
        self.server = server
        self.plan = plan
        self.outcomes: list[StreamOutcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, worker: int) -> None:
        client = openai.OpenAI(
            base_url=f"{self.server.url}/v1",
            api_key="unused",
            max_retries=0,
            timeout=HTTP_TIMEOUT_S,
        )
        n = 0
        while not self._stop.is_set():
            label, create = self.plan(worker, n)
            n += 1
            pieces: list[str] = []
            reasons: list[str] = []
            usage: int | None = None
            error = None
            started_at = time.monotonic()
            try:
                chunks = client.chat.completions.create(
                    model=MODEL, stream=True, stream_options={"include_usage": True}, **create
                )
                for chunk in chunks:
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        pieces.append(choice.delta.content or "")
                        if choice.finish_reason is not None:
                            reasons.append(choice.finish_reason)
            except Exception as exc:  # the test looks at it
                error = repr(exc)
            self.outcomes.append(
                StreamOutcome(
                    label, started_at, time.monotonic(), error, "".join(pieces), reasons, usage
                )
            )

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(SETTLE_S)
            assert not thread.is_alive(), "a stream still running: a hang"


class FleetWatch:
    """GET /admin/fleet every 50 ms: each replica's states in the order seen, with the time
    each was first seen ("gone" once its row is no longer listed)."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.seen: dict[int, list[tuple[str, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            rows = {row["id"]: row["state"] for row in fleet_rows(self.server)}
            now = time.monotonic()
            for replica_id in rows.keys() | self.seen.keys():
                state = rows.get(replica_id, "gone")
                states = self.seen.setdefault(replica_id, [])
                if not states or states[-1][0] != state:
                    states.append((state, now))
            time.sleep(0.05)

    def stop(self) -> dict[int, list[tuple[str, float]]]:
        self._stop.set()
        self._thread.join(HTTP_TIMEOUT_S)
        return self.seen


def paths(seen: dict[int, list[tuple[str, float]]], *, but: str = "") -> dict[int, list[str]]:
    """Each replica's states in order, without their times (and without `but`'s)."""
    return {i: [s for s, _ in states if s != but] for i, states in seen.items()}
