"""The fleet on a real 3-node Ray cluster on this machine (Ray's own test cluster: a head
and two worker nodes, each a raylet of its own, every socket on 127.0.0.1), with gateways
(`tokenfleet serve --ray-address`) started through live_server and driven through the
official clients. Replicas run the fixed runner (every token " a", each step 10 ms), so
every answer is known in advance: a stream has exactly max_tokens tokens of " a" or the
fleet lost or repeated one.

Faults are real ones: SIGKILL of a replica's process (Ray restarts it), a worker node
removed from the cluster (Ray restarts its replicas on the other), SIGKILL of a gateway
(the replicas abort its requests). The tests share one cluster and one gateway; the node
removal comes late, since the cluster keeps one worker after it, and the replica whose
restarts are used up comes last, since it stays dead.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server, wait_until
from support.ray_cluster import (
    RayTestCluster,
    busiest,
    descendants,
    fleet_moves,
    fleet_rows,
    is_loopback,
    listening_sockets,
    ray_actor,
    ray_cluster,
    wait_fleet_ready,
)

pytestmark = pytest.mark.fake("runner")

NUM_REPLICAS = 4
# Each worker node can hold every replica: whichever node goes, the other takes them all.
REPLICAS_PER_NODE = [NUM_REPLICAS, NUM_REPLICAS]
STEP_S = "0.01"  # a step of the fixed runner: a stream of N tokens lasts at least N steps
FIXED = " a"  # the fixed runner's token, as text
MAX_TOKENS = 400
# Bounds that only a hang reaches (a restarted replica is ready in about a second here).
BACK_S = 90.0
STREAM_S = 120.0
RESTARTS = 8  # each replica's --replica-restarts: Ray's bound, then the replica stays dead


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayTestCluster]:
    with ray_cluster(tmp_path_factory.mktemp("ray"), REPLICAS_PER_NODE) as c:
        yield c


def fleet_args(cluster: RayTestCluster, *more: str) -> list[str]:
    """A gateway's flags: the fixed runner (the first gateway's engine settings are the
    replicas'), the cluster, the replicas it shares with every other gateway on it."""
    args = ["--runner", "fixed", "--fixed-step-time", STEP_S, "--ray-address", cluster.address]
    return [*args, "--replicas", str(NUM_REPLICAS), "--replica-restarts", str(RESTARTS), *more]


@pytest.fixture(scope="module")
def gateway(
    cluster: RayTestCluster, model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """The gateway that creates the replicas, shared by the tests. No --model: the
    replicas and the gateways take the bundled model from this machine's cache, where
    `model_folder` has put it (with a folder, each gateway would first check every node
    for it with a Ray task: a new worker process per node, seconds each here)."""
    tmp = tmp_path_factory.mktemp("gateway")
    with live_server(tmp, *fleet_args(cluster)) as server:
        wait_fleet_ready(server, NUM_REPLICAS)
        yield server


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
    )


@dataclass
class Stream:
    """A streamed chat completion through the official client, read in a thread while the
    test breaks something."""

    server: LiveServer
    max_tokens: int
    name: str
    pieces: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    error: Exception | None = None

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            chunks = client(self.server).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Stream {self.name}"}],
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in chunks:
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content:
                        self.pieces.append(choice.delta.content)
                    if choice.finish_reason is not None:
                        self.finish_reasons.append(choice.finish_reason)
        except Exception as exc:  # the test looks at it
            self.error = exc

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def num_tokens(self) -> int:
        return self.text.count(FIXED)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> Stream:
        self._thread.join(STREAM_S)
        assert not self._thread.is_alive(), f"stream {self.name} still running: a hang"
        return self

    def outcome(self) -> tuple[Exception | None, str, list[str], int | None]:
        return self.error, self.text, self.finish_reasons, self.completion_tokens


def whole(max_tokens: int) -> tuple[None, str, list[str], int]:
    """A stream that was not cut short: exactly max_tokens fixed tokens, no error."""
    return None, FIXED * max_tokens, ["length"], max_tokens


def streams_under_way(server: LiveServer, count: int, max_tokens: int = MAX_TOKENS) -> list[Stream]:
    """`count` streams, each with 10 tokens received and far more to come."""
    streams = [Stream(server, max_tokens, f"{n}") for n in range(count)]
    wait_until(lambda: all(s.num_tokens >= 10 for s in streams), STREAM_S, "10 tokens each")
    assert not any(s.done for s in streams), [s.outcome() for s in streams if s.done]
    return streams


def row(server: LiveServer, replica_id: int) -> dict[str, Any]:
    return next(r for r in fleet_rows(server) if r["id"] == replica_id)


def wait_back(server: LiveServer, before: dict[str, Any]) -> dict[str, Any]:
    """The replica's row once it is ready again as a new incarnation."""

    def back() -> dict[str, Any] | None:
        now = row(server, before["id"])
        if now["state"] == "ready" and now["incarnation"] != before["incarnation"]:
            return now
        return None

    now = wait_until(back, BACK_S, f"replica {before['id']} back as a new incarnation")
    assert now is not None
    return now


# -- every socket on loopback -----------------------------------------------------------------


def test_every_socket_ray_and_tokenfleet_listen_on_is_on_loopback(
    cluster: RayTestCluster, gateway: LiveServer
) -> None:
    """The listening TCP sockets of this test's processes (pytest, a Ray driver here, and
    its descendants: Ray's GCS, raylets and workers, the replicas, the gateway): all on
    127.0.0.1, among them the gateway's HTTP port, each replica's bridge and Ray's GCS."""
    rows = wait_fleet_ready(gateway, NUM_REPLICAS)
    sockets = listening_sockets(descendants(os.getpid()) | {os.getpid()})
    assert sockets, "no listening socket found: the test could not fail"
    assert {str(address) for address, _ in sockets.values() if not is_loopback(address)} == set()
    ports = {port for _, port in sockets.values()}
    expected = {int(gateway.url.rsplit(":", 1)[1]), int(cluster.address.rsplit(":", 1)[1])}
    expected |= {int(r["address"].rsplit(":", 1)[1]) for r in rows}
    assert expected <= ports
    assert {r["address"].split(":")[1] for r in rows} == {"//127.0.0.1"}


# -- a model folder missing on a node ---------------------------------------------------------


def test_a_gateway_given_a_model_folder_missing_on_a_node_stops_naming_that_node(
    cluster: RayTestCluster, gateway: LiveServer, model_folder: Path, tmp_path: Path
) -> None:
    """A third worker node that cannot see the model folder (an empty tmpfs over it, in a
    mount namespace of its own): a gateway started with `--model` that folder exits
    before serving, with the error naming that node and no other; the replicas already
    running are untouched, and a gateway without `--model` still starts."""
    wait_fleet_ready(gateway, NUM_REPLICAS)
    with (
        cluster.node_without(model_folder) as node_id,
        pytest.raises(RuntimeError, match="server exited") as failed,
        live_server(tmp_path, *fleet_args(cluster), model_folder=model_folder),
    ):
        pass
    log = str(failed.value)
    expected = f"the model folder {str(model_folder)!r} (config.json and weights) is "
    expected += f"missing on node(s) 127.0.0.1 ({node_id[:12]}): every node that can "
    assert expected in log, log
    assert Stream(gateway, 20, "after the failed start").join().outcome() == whole(20)
    assert [r["state"] for r in wait_fleet_ready(gateway, NUM_REPLICAS)] == ["ready"] * 4


# -- a replica killed -------------------------------------------------------------------------


def test_a_replica_killed_mid_stream_loses_no_token_and_comes_back(gateway: LiveServer) -> None:
    """SIGKILL of the process of the replica serving the most streams: every stream ends
    with exactly max_tokens tokens and no error (the killed replica's move to the others
    with the tokens they had); Ray restarts the replica, which the gateway shows ready
    again as a new incarnation with one restart more."""
    wait_fleet_ready(gateway, NUM_REPLICAS)
    streams = streams_under_way(gateway, 8)
    victim = busiest(fleet_rows(gateway))
    moves = fleet_moves(gateway)
    os.kill(victim["pid"], signal.SIGKILL)
    assert [s.join().outcome() for s in streams] == [whole(MAX_TOKENS)] * len(streams)
    # Each of the victim's streams moved once (the count the gateway exports).
    assert fleet_moves(gateway) == moves + victim["requests_from_this_gateway"]
    back = wait_back(gateway, victim)
    assert back["restarts"] == victim["restarts"] + 1
    assert back["pid"] != victim["pid"] and back["requests_from_this_gateway"] == 0


def test_a_batch_with_a_replica_killed_midway_has_one_success_per_request(
    gateway: LiveServer,
) -> None:
    """An OpenAI batch (Files + Batches, official client) of 300 requests; a replica is
    killed once some results are in and others run on it: the batch completes with
    exactly one succeeded result per request, each the whole answer."""
    wait_fleet_ready(gateway, NUM_REPLICAS)
    num_requests, max_tokens = 300, 100
    openai_client = client(gateway)
    lines = [
        {
            "custom_id": f"r{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Item {n}"}],
                "max_tokens": max_tokens,
            },
        }
        for n in range(num_requests)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = openai_client.files.create(file=("batch.jsonl", data), purpose="batch")
    batch = openai_client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def midway() -> dict[str, Any] | None:
        counts = openai_client.batches.retrieve(batch.id).request_counts
        assert counts is not None and counts.completed < num_requests, "ended before the kill"
        rows = fleet_rows(gateway)
        running = [r for r in rows if r["requests_from_this_gateway"] > 0]
        return busiest(rows) if counts.completed > 0 and running else None

    victim = wait_until(midway, STREAM_S, "some results in, others running")
    assert victim is not None
    os.kill(victim["pid"], signal.SIGKILL)

    def ended() -> Any:
        found = openai_client.batches.retrieve(batch.id)
        return found if found.status in ("completed", "failed", "expired", "cancelled") else None

    done = wait_until(ended, STREAM_S, "the batch ended", every=0.2)
    assert done.status == "completed" and done.error_file_id is None
    assert done.request_counts is not None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (num_requests, num_requests, 0)
    assert done.output_file_id is not None
    content = openai_client.files.content(done.output_file_id).content.decode()
    results = [json.loads(line) for line in content.splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{n}" for n in range(num_requests))
    answers = {
        (
            r["response"]["status_code"],
            r["response"]["body"]["choices"][0]["message"]["content"],
            r["response"]["body"]["choices"][0]["finish_reason"],
            r["response"]["body"]["usage"]["completion_tokens"],
            r["error"],
        )
        for r in results
    }
    assert answers == {(200, FIXED * max_tokens, "length", max_tokens, None)}
    wait_back(gateway, victim)


# -- a gateway killed -------------------------------------------------------------------------


def test_a_gateway_killed_mid_stream_leaves_the_other_streaming_and_its_requests_aborted(
    cluster: RayTestCluster,
    gateway: LiveServer,
    tmp_path: Path,
    postgres_url: str,
) -> None:
    """Two more gateways on the cluster, sharing one PostgreSQL store, stream at once;
    one is SIGKILLed. The other's streams go on to their exact ends; the replicas abort
    the dead gateway's requests once it is silent for their gateway timeout (5 s): the
    requests running on the replicas, as the survivor sees them, are again its own only,
    while its own still run."""
    args = fleet_args(cluster, "--database-url", postgres_url)
    with (
        live_server(tmp_path, *args, "--gateway-id", "doomed") as doomed,
        live_server(tmp_path, *args, "--gateway-id", "survivor") as alive,
    ):
        wait_fleet_ready(doomed, NUM_REPLICAS)
        wait_fleet_ready(alive, NUM_REPLICAS)
        # The doomed gateway's requests would run for 30 s at least; the survivor's for 10.
        theirs = streams_under_way(doomed, 4, max_tokens=3000)
        ours = streams_under_way(alive, 2, max_tokens=1000)

        def running() -> tuple[int, int]:
            rows = fleet_rows(alive)
            own = sum(r["requests_from_this_gateway"] for r in rows)
            return sum(r["running"] for r in rows), own

        wait_until(lambda: running() == (6, 2), STREAM_S, "both gateways' requests running")
        os.kill(doomed.process.pid, signal.SIGKILL)
        for stream in theirs:
            assert stream.join().error is not None  # its connection was cut
        # The gateway timeout (5 s) and a margin for a loaded machine, well under the 30 s
        # the dead gateway's requests would still run for.
        wait_until(lambda: running() == (2, 2), 15, "only the survivor's requests running")
        assert [s.join().outcome() for s in ours] == [whole(1000)] * 2
        assert Stream(alive, 50, "after").join().outcome() == whole(50)


# -- no moves allowed -------------------------------------------------------------------------


def test_with_max_moves_0_a_killed_replicas_streams_end_with_an_error(
    cluster: RayTestCluster,
    gateway: LiveServer,
    tmp_path: Path,
) -> None:
    """A gateway with --max-moves 0: the streams of the replica killed end at once with an
    error event (the official client raises APIError), none hangs; the other streams end
    whole."""
    wait_fleet_ready(gateway, NUM_REPLICAS)
    args = fleet_args(cluster, "--max-moves", "0")
    with live_server(tmp_path, *args) as strict:
        wait_fleet_ready(strict, NUM_REPLICAS)
        streams = streams_under_way(strict, 8)
        victim = busiest(fleet_rows(strict))
        os.kill(victim["pid"], signal.SIGKILL)
        outcomes = [s.join() for s in streams]
        failed = [s for s in outcomes if s.error is not None]
        assert len(failed) == victim["requests_from_this_gateway"]
        for stream in failed:
            assert isinstance(stream.error, openai.APIError), repr(stream.error)
            assert "moved 0 times" in str(stream.error)
            assert 10 <= stream.num_tokens < MAX_TOKENS and stream.finish_reasons == []
        others = [s.outcome() for s in outcomes if s.error is None]
        assert others == [whole(MAX_TOKENS)] * (len(streams) - len(failed))
    wait_back(gateway, victim)


# -- a node removed (last: the cluster has one worker node after it) -------------------------


def test_a_node_removed_mid_stream_loses_no_token_and_its_replicas_restart_elsewhere(
    cluster: RayTestCluster, gateway: LiveServer
) -> None:
    """cluster.remove_node of the worker node holding the busiest replica: every stream
    ends whole, and each replica that was on the node comes back on the other node as a
    new incarnation with one restart more."""
    rows = wait_fleet_ready(gateway, NUM_REPLICAS)
    streams = streams_under_way(gateway, 8)
    victim = busiest(fleet_rows(gateway))
    gone = [r for r in rows if r["node"] == victim["node"]]
    cluster.remove_node(cluster.node(victim["node"]))
    assert [s.join().outcome() for s in streams] == [whole(MAX_TOKENS)] * len(streams)
    (remaining,) = (n.node_id for n in cluster.replica_nodes)
    for before in gone:
        back = wait_back(gateway, before)
        assert back["node"] == remaining and back["restarts"] == before["restarts"] + 1


# -- a replica whose restarts are used up (last: it stays dead) ------------------------------


def test_a_replica_past_its_restarts_is_dead_and_the_gateway_goes_on_with_the_others(
    gateway: LiveServer,
) -> None:
    """A replica SIGKILLed until Ray has restarted it --replica-restarts times (Ray's own
    count), then once more while 8 streams run: Ray leaves it dead, GET /admin/fleet shows
    it `dead` (and still so after more streams), the streams it held move and every
    stream ends whole, and new streams run on the others alone."""
    wait_fleet_ready(gateway, NUM_REPLICAS)
    victim = fleet_rows(gateway)[0]
    actor_id = ray_actor(victim["id"])["ActorID"]
    record = ray_actor(victim["id"])
    while record["NumRestarts"] < RESTARTS:
        os.kill(row(gateway, victim["id"])["pid"], signal.SIGKILL)
        before = record["NumRestarts"]
        wait_back(gateway, victim)
        victim = row(gateway, victim["id"])
        record = ray_actor(victim["id"])
        assert record["NumRestarts"] == before + 1 and record["State"] == "ALIVE"
    streams = streams_under_way(gateway, 8)
    moves, on_victim = fleet_moves(gateway), row(gateway, victim["id"])
    os.kill(on_victim["pid"], signal.SIGKILL)
    assert [s.join().outcome() for s in streams] == [whole(MAX_TOKENS)] * len(streams)
    assert fleet_moves(gateway) == moves + on_victim["requests_from_this_gateway"]
    wait_until(lambda: row(gateway, victim["id"])["state"] == "dead", BACK_S, "shown dead")
    record = ray_actor(victim["id"], actor_id)
    assert (record["State"], record["NumRestarts"]) == ("DEAD", RESTARTS)
    later = [Stream(gateway, 50, f"later {n}") for n in range(8)]
    assert [s.join().outcome() for s in later] == [whole(50)] * 8
    rows = fleet_rows(gateway)
    assert [(r["id"], r["state"]) for r in rows] == [
        (r["id"], "dead" if r["id"] == victim["id"] else "ready") for r in rows
    ]
    assert row(gateway, victim["id"])["requests_from_this_gateway"] == 0
