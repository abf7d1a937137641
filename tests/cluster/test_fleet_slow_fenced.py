"""Slow and frozen replicas on a real 3-node Ray cluster on this machine (Ray's own test
cluster, every socket on 127.0.0.1), a gateway (`tokenfleet serve --ray-address`) over 3
fixed-runner replicas (every token " a", each step 10 ms), driven through the official
client: a stream with exactly max_tokens of " a" and no error lost and repeated nothing.

- A replica slowed 3x (its fixed runner's steps 10 ms -> 30 ms, through the actor's
  test-only knob) is `slow` within SLOW_WITHIN_WINDOWS of its windows (beats) and gets no
  new work; restored, it gets work again.
- A replica's process SIGSTOPped (Ray never notices: ../shared/RAY.md): past the replica
  timeout its streams go on on the others; woken (SIGCONT) before the fence timeout, what
  it sends of the moved streams is dropped and it serves again; frozen past the fence
  timeout, it is `fenced`, Ray replaces it, and whatever the frozen process sends when
  woken is dropped.

The tests share one cluster and one gateway; about 60 s in all on the 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.live_server import (
    HTTP_TIMEOUT_S,
    MODEL,
    LiveServer,
    live_server,
    metric_value,
    wait_gone,
    wait_until,
)
from support.ray_cluster import RayTestCluster, busiest, fleet_rows, ray_cluster, wait_fleet_ready

from tokenfleet.cluster.health import SLOW_WITHIN_WINDOWS
from tokenfleet.cluster.placement import NAMESPACE

pytestmark = pytest.mark.fake("runner")

NUM_REPLICAS = 3
STEP_S = 0.01
FIXED = " a"
REPLICA_TIMEOUT_S = "1.5"
FENCE_TIMEOUT_S = "6"
BOUND_S = 90.0  # bounds only a hang reaches


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayTestCluster]:
    with ray_cluster(tmp_path_factory.mktemp("ray"), [NUM_REPLICAS, NUM_REPLICAS]) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(
    cluster: RayTestCluster, model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    args = ["--runner", "fixed", "--fixed-step-time", str(STEP_S)]
    args += ["--ray-address", cluster.address, "--replicas", str(NUM_REPLICAS)]
    args += ["--replica-timeout", REPLICA_TIMEOUT_S, "--fence-timeout", FENCE_TIMEOUT_S]
    args += ["--slow-replica-factor", "2"]
    with live_server(tmp_path_factory.mktemp("gateway"), *args) as server:
        wait_fleet_ready(server, NUM_REPLICAS)
        yield server


@dataclass
class Stream:
    """A streamed chat completion through the official client, read in a thread."""

    server: LiveServer
    max_tokens: int
    name: str
    pieces: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    error: Exception | None = None

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        client = openai.OpenAI(
            base_url=f"{self.server.url}/v1",
            api_key="unused",
            max_retries=0,
            timeout=HTTP_TIMEOUT_S,
        )
        try:
            chunks = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Stream {self.name}"}],
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
            )
            for chunk in chunks:
                for choice in chunk.choices:
                    if choice.delta.content:
                        self.pieces.append(choice.delta.content)
                    if choice.finish_reason is not None:
                        self.finish_reasons.append(choice.finish_reason)
        except Exception as exc:  # the test looks at it
            self.error = exc

    @property
    def num_tokens(self) -> int:
        return "".join(self.pieces).count(FIXED)

    def outcome(self) -> tuple[Exception | None, str, list[str]]:
        self._thread.join(BOUND_S)
        assert not self._thread.is_alive(), f"stream {self.name} still running: a hang"
        return self.error, "".join(self.pieces), self.finish_reasons


def whole(max_tokens: int) -> tuple[None, str, list[str]]:
    return None, FIXED * max_tokens, ["length"]


def under_way(server: LiveServer, names: list[str], max_tokens: int) -> list[Stream]:
    streams = [Stream(server, max_tokens, name) for name in names]
    wait_until(lambda: all(s.num_tokens >= 10 for s in streams), BOUND_S, "10 tokens each")
    return streams


def row(server: LiveServer, replica_id: int) -> dict[str, Any]:
    return next(r for r in fleet_rows(server) if r["id"] == replica_id)


def fleet(server: LiveServer) -> dict[str, Any]:
    reply = httpx.get(f"{server.url}/admin/fleet", timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=HTTP_TIMEOUT_S).text
    return metric_value(text, name)


def slow_down(replica_id: int, extra_step_s: float) -> None:
    """The replica's fixed runner: each step `extra_step_s` longer (the test-only knob)."""
    import ray

    actor = ray.get_actor(f"replica-{replica_id}", namespace=NAMESPACE)
    ray.get(actor.set_extra_step_s_for_tests.remote(extra_step_s), timeout=30)


def test_a_replica_slowed_3x_gets_no_new_work_within_the_stated_windows_until_restored(
    gateway: LiveServer,
) -> None:
    """The busiest replica's steps go to 3x (10 to ~30 ms) while 6 long streams run: it is
    shown `slow` (its average and the others' median in its row, the /metrics gauge at 1)
    within SLOW_WITHIN_WINDOWS windows of the change; 6 new streams then all go to the
    other two. Restored to 10 ms, it is `ready` again and new streams reach it. Every
    stream, the slowed ones included, ends whole."""
    wait_fleet_ready(gateway, NUM_REPLICAS)
    long = under_way(gateway, [f"long {n}" for n in range(6)], 800)
    victim = busiest(fleet_rows(gateway))["id"]  # it has streams running
    # 3x its step as measured (the runner's 10 ms and the engine's own time per step).
    measured_ms = wait_until(lambda: row(gateway, victim)["step_ms_avg"], BOUND_S, "measured")
    try:
        slow_down(victim, 2 * measured_ms / 1000)
        windows_at_change = row(gateway, victim)["step_windows"]
        slow = wait_until(
            lambda: (r := row(gateway, victim))["state"] == "slow" and r, BOUND_S, "the victim slow"
        )
        assert slow["slow_at_window"] - windows_at_change <= SLOW_WITHIN_WINDOWS, slow
        assert slow["step_ms_avg"] > 2 * slow["step_ms_median"], slow
        assert fleet(gateway)["slow_replica_factor"] == 2.0
        assert metric(gateway, "tokenfleet_fleet_replicas_slow") == 1.0
        routed = slow["routed"]
        short = [Stream(gateway, 50, f"short {n}") for n in range(6)]
        assert [s.outcome() for s in short] == [whole(50)] * 6
        assert row(gateway, victim)["routed"] == routed  # no new work while slow
    finally:
        slow_down(victim, 0.0)  # restored (the other test needs it whole, even after a failure)
    wait_until(lambda: row(gateway, victim)["state"] == "ready", BOUND_S, "the victim ready again")
    assert metric(gateway, "tokenfleet_fleet_replicas_slow") == 0.0
    # New work reaches it again: within 3 rounds of 6 streams (on a machine this busy a
    # replica may be judged slow for a moment, and then take none of a round).
    for round_ in range(3):
        later = [Stream(gateway, 50, f"later {round_} {n}") for n in range(6)]
        assert [s.outcome() for s in later] == [whole(50)] * 6
        if row(gateway, victim)["routed"] > routed:
            break
    assert row(gateway, victim)["routed"] > routed
    assert [s.outcome() for s in long] == [whole(800)] * 6


def test_a_sigstopped_replicas_streams_go_on_elsewhere_and_its_late_output_is_dropped(
    gateway: LiveServer,
) -> None:
    """SIGSTOP of the busiest replica's process. Past the replica timeout it is `silent`
    and its streams move (one move each); SIGCONT then, before the fence timeout: what it
    sends of the moved streams is dropped (the counter in /admin/fleet and /metrics), it
    is `ready` again as the same incarnation (never `slow`: the stall is not timed as a
    step), and every stream is whole (no token twice).
    Stopped again past the fence timeout: `fenced`, its streams whole on the others, Ray
    replaces it (a new incarnation, one restart more); the old process, woken, is gone
    or ignored."""
    wait_fleet_ready(gateway, NUM_REPLICAS)
    streams = under_way(gateway, [f"a {n}" for n in range(6)], 600)
    victim = busiest(fleet_rows(gateway))
    before = fleet(gateway)
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        wait_until(lambda: row(gateway, victim["id"])["state"] == "silent", BOUND_S, "silent")
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    wait_until(
        lambda: fleet(gateway)["dropped_messages"] > before["dropped_messages"],
        BOUND_S,
        "its late outputs dropped",
    )
    assert metric(gateway, "tokenfleet_fleet_dropped_messages_total") > 0
    assert [s.outcome() for s in streams] == [whole(600)] * 6
    assert fleet(gateway)["moves"] == before["moves"] + victim["requests_from_this_gateway"]
    woken = wait_until(
        lambda: (r := row(gateway, victim["id"]))["state"] == "ready" and r, BOUND_S, "ready"
    )
    assert (woken["incarnation"], woken["restarts"]) == (victim["incarnation"], 0)
    # The stall is not taken for a slow step once it wakes.
    assert fleet(gateway)["slow_episodes"] == before["slow_episodes"]

    # Frozen past the fence timeout.
    streams = under_way(gateway, [f"b {n}" for n in range(6)], 600)
    victim = busiest(fleet_rows(gateway))
    fenced = fleet(gateway)["fenced"]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        wait_until(lambda: row(gateway, victim["id"])["state"] == "fenced", BOUND_S, "fenced")
        assert fleet(gateway)["fenced"] == fenced + 1
    finally:
        with contextlib.suppress(ProcessLookupError):  # its late words, if Ray let it live
            os.kill(victim["pid"], signal.SIGCONT)
    assert [s.outcome() for s in streams] == [whole(600)] * 6
    back = wait_until(
        lambda: (
            (r := row(gateway, victim["id"]))["state"] == "ready"
            and r["incarnation"] != victim["incarnation"]
            and r
        ),
        BOUND_S,
        "replaced by a new incarnation",
    )
    assert back["restarts"] == victim["restarts"] + 1 and back["pid"] != victim["pid"]
    assert wait_gone(victim["pid"], BOUND_S)
    assert metric(gateway, "tokenfleet_fleet_replicas_fenced_total") == 1.0
    assert [s.outcome() for s in [Stream(gateway, 50, "after")]] == [whole(50)]
