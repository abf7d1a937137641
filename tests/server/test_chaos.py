"""Chaos: a 2,000-request batch through real `tokenfleet serve` processes (the fixed runner,
so that it fits in CI) while they are SIGKILLed at random moments and the store fails
under them, on SQLite and on PostgreSQL.

Injected, per store:

- 3 SIGKILLs of the engine alone (the gateway starts a new one by itself) and 2 of the
  gateway alone (its engine dies with it); a new gateway then takes over on the same store,
  the first time under a new id (the dead one's leases come back when they expire), the
  second under the dead one's id (they come back at its start). The order of the kinds and
  the point of the batch's progress each kill waits for are drawn from a seeded
  random.Random: TOKENFLEET_CHAOS_SEED, or a fixed default; the seed is printed. Each kill
  waits for its point and then for batch requests running in the engine (/metrics); all 5
  land within 150 s (KILL_WINDOW_S) of the batch's creation.
- The store failing, from another connection, every 0.4-1.2 s (seeded) until the batch
  ends (20-50 times a run). SQLite: the write lock held for 0.1-0.3 s while the gateways
  wait 50 ms for a lock (`?timeout=0.05`), so their writes fail "database is locked".
  PostgreSQL: the gateways' connections terminated (pg_terminate_backend, found by their
  application_name), or the requests table locked for 0.1-0.3 s beyond their lock_timeout
  (100 ms). Paused while a gateway starts: a gateway that cannot open its store at start
  exits, for its supervisor to start again.

Asserted: each kill found the batch in progress and took its process (a killed gateway's
engine too), and the killed gateways held leases; the batch ends with exactly one result
line per custom_id, none missing or doubled, each the fixed runner's answer;
request_counts reconcile (2,000 succeeded, nothing processing: no request can fail 10
attempts with 3 engine deaths); every store row succeeded with its result and no lease;
engine deaths were counted as failed attempts (at most one per kill) and the gateways'
store loops met the faults and retried.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest
from sqlalchemy import Engine, text
from support.chaos import Gateways, StoreFaults, postgres_store, sqlite_store
from support.live_server import MODEL, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.fake("runner")]

NUM_REQUESTS = 2000
MAX_TOKENS = 8  # the fixed runner answers " a" per token
ENGINE_KILLS = 3
GATEWAY_KILLS = 2
MAX_ATTEMPTS = 10  # above ENGINE_KILLS: every request must succeed
KILL_WINDOW_S = 150.0  # every kill lands within this of the batch's creation
BATCH_DEADLINE_S = 200.0  # only a hang reaches it
DEFAULT_SEED = 20260603
SERVE_ARGS = (
    "--runner", "fixed",
    "--max-num-seqs", "128",  # 16 kept waiting in the engine: the batch moves fast
    "--lease-seconds", "5",  # a dead gateway's leases expire while the next one starts
    "--batch-max-attempts", str(MAX_ATTEMPTS),
    "--engine-restart-backoff", "0.1",
    "--engine-restart-backoff-max", "1",
)  # fmt: skip


def row_counts(reader: Engine, batch_id: str) -> dict[str, int]:
    with reader.connect() as conn:
        rows = conn.execute(
            text("SELECT status, count(*) FROM batch_requests WHERE batch_id = :b GROUP BY status"),
            {"b": batch_id},
        ).all()
    return {status: num for status, num in rows}


def leased_by(reader: Engine, batch_id: str, owner: str) -> int:
    with reader.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM batch_requests"
                    " WHERE batch_id = :b AND status = 'leased' AND lease_owner = :o"
                ),
                {"b": batch_id, "o": owner},
            ).scalar_one()
        )


def num_done(counts: dict[str, int]) -> int:
    return sum(n for status, n in counts.items() if status not in ("queued", "leased"))


def batch_ended(reader: Engine, batch_id: str) -> bool:
    with reader.connect() as conn:
        state = conn.execute(text("SELECT state FROM batches WHERE id = :b"), {"b": batch_id})
        return bool(state.scalar() == "ended")


def kill_plan(rng: random.Random) -> list[tuple[str, int]]:
    """(kind, the number of finished requests it waits for), in order: the kinds shuffled,
    each point drawn in its own fifth of 5-60 % of the batch, so that every kill lands
    mid-batch (800 requests left at least: several seconds' work at the fastest, against
    the moment from a look at the store to the kill; with 500, a CI run's batch once ended
    before its last kill's point was seen with batch requests running) and each waits for
    progress since the one before."""
    kinds = ["engine"] * ENGINE_KILLS + ["gateway"] * GATEWAY_KILLS
    rng.shuffle(kinds)
    span = 0.55 / len(kinds)
    return [
        (kind, int(NUM_REQUESTS * (0.05 + span * (k + rng.random()))))
        for k, kind in enumerate(kinds)
    ]


def batch_requests() -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"chaos-{i}",
            "params": {
                "model": MODEL,
                "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": f"Item {i}"}],
            },
        }
        for i in range(NUM_REQUESTS)
    ]


# -- the test -----------------------------------------------------------------------------------


@pytest.mark.parametrize("store_kind", ["sqlite", "postgresql"])
def test_chaos_fixed_runner_sigkills_and_store_faults_leave_exactly_one_result_each(
    tmp_path: Path, request: pytest.FixtureRequest, store_kind: str
) -> None:
    seed = int(os.environ.get("TOKENFLEET_CHAOS_SEED", DEFAULT_SEED))
    rng = random.Random(seed)
    plan = kill_plan(rng)
    print(f"chaos seed {seed} (replay: TOKENFLEET_CHAOS_SEED={seed}); kills: {plan}")
    if store_kind == "sqlite":
        store = sqlite_store(tmp_path)
    else:
        store = postgres_store(request.getfixturevalue("postgres_url"))
    faults = StoreFaults(store.inject, seed + 1)
    gateways = Gateways(tmp_path, (*SERVE_ARGS, "--database-url", store.server_url))
    try:
        gateway_id = "chaos-gateway-0"
        server = gateways.start(gateway_id)
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        batch_id = client.messages.batches.create(requests=batch_requests()).id
        created = time.monotonic()
        faults.start()

        kills: list[tuple[str, float, dict[str, int]]] = []
        orphaned = 0  # leases the killed gateways held
        for kind, point in plan:
            engine_pid = gateways.engine_pid()

            def due(point: int = point, kind: str = kind) -> dict[str, int] | None:
                """The counts once `point` requests are done and some are leased; for an
                engine kill, also once batch requests are in the engine, running or
                waiting (while store faults hold up commits it may sit idle): the kill
                then fails them. A gateway kill needs only the leases it leaves behind.
                (Waiting for the engine's running gauge alone, a loaded machine's polls
                once missed every moment of it before the batch ended.)"""
                counts = row_counts(store.reader, batch_id)
                assert num_done(counts) < NUM_REQUESTS, "the batch ended before the kill"
                if num_done(counts) < point or not counts.get("leased"):
                    return None
                if kind == "gateway":
                    return counts
                return counts if gateways.batch_in_engine() > 0 else None

            left_s = created + KILL_WINDOW_S - time.monotonic()
            before = wait_until(due, left_s, f"{point} done, for a {kind} kill", every=0.02)
            if kind == "engine":
                gateways.kill_engine(engine_pid)
            else:
                gateways.kill_gateway(engine_pid)
                orphaned += leased_by(store.reader, batch_id, gateway_id)
                # The first takeover under a new id, the second under the dead one's.
                if not any(k == "gateway" for k, _, _ in kills):
                    gateway_id = "chaos-gateway-1"
            killed_at = time.monotonic() - created
            after = num_done(row_counts(store.reader, batch_id))
            assert after < NUM_REQUESTS, f"the {kind} kill came after the batch's end"
            kills.append((kind, killed_at, before))
            if kind == "gateway":
                with faults.paused():
                    gateways.start(gateway_id)
        print(f"chaos kills (kind, s after the create, request counts just before): {kills}")
        assert [k for k, _, _ in kills] == [k for k, _ in plan]
        assert all(at <= KILL_WINDOW_S for _, at, _ in kills), kills
        assert orphaned > 0, "no gateway kill left a lease behind"

        wait_until(
            lambda: batch_ended(store.reader, batch_id),
            created + BATCH_DEADLINE_S - time.monotonic(),
            "the batch ended",
            every=0.02,
        )
        faults.stop()
        print(
            f"chaos on {store_kind}: {faults.num_injected} store faults injected; "
            f"the batch ended {time.monotonic() - created:.1f} s after its create"
        )

        assert gateways.server is not None
        client = anthropic.Anthropic(base_url=gateways.server.url, api_key="unused", max_retries=0)
        batch = client.messages.batches.retrieve(batch_id)
        assert batch.processing_status == "ended"
        assert batch.request_counts.model_dump() == {
            "processing": 0,
            "succeeded": NUM_REQUESTS,
            "errored": 0,
            "canceled": 0,
            "expired": 0,
        }
        lines = list(client.messages.batches.results(batch_id))
        custom_ids = [line.custom_id for line in lines]
        assert len(custom_ids) == len(set(custom_ids)) == NUM_REQUESTS  # none doubled
        assert set(custom_ids) == {f"chaos-{i}" for i in range(NUM_REQUESTS)}  # none missing
        for line in lines:
            assert line.result.type == "succeeded", line
            message = line.result.message
            assert [block.text for block in message.content] == [" a" * MAX_TOKENS], line  # type: ignore[union-attr]
            assert message.usage.output_tokens == MAX_TOKENS, line

        with store.reader.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT status, result IS NOT NULL AS has_result, lease_owner, failures,"
                    " attempts FROM batch_requests WHERE batch_id = :b"
                ),
                {"b": batch_id},
            ).all()
        assert len(rows) == NUM_REQUESTS
        assert all(r.status == "succeeded" and r.has_result for r in rows)
        assert all(r.lease_owner is None for r in rows)
        failures = [r.failures for r in rows]
        retried = gateways.store_retries()
        print(
            f"chaos on {store_kind}: {sum(failures)} attempts failed by an engine death, "
            f"{sum(r.attempts > 1 for r in rows)} requests leased more than once, "
            f"{retried} store calls failed and retried; the killed gateways held "
            f"{orphaned} leases"
        )
        assert sum(failures) > 0, "no engine kill caught a request running"
        assert max(failures) <= ENGINE_KILLS  # a death counts once per request it ran
        assert retried > 0, "no store fault reached the gateways"
    finally:
        with contextlib.suppress(AssertionError):
            faults.stop()
        gateways.close()
        store.reader.dispose()
