"""Scaling a fleet by hand on a real 3-node Ray cluster on this machine (Ray's own test
cluster, every socket on 127.0.0.1): a gateway (`tokenfleet serve --ray-address`) with 2
fixed-runner replicas is scaled to 4 by `tokenfleet fleet scale 4` and back to 2 by
POST /admin/fleet/scale while streams run without pause and an OpenAI batch of a few
hundred requests runs across both, through the official client.

The fixed runner makes every answer known in advance (each token " a", a step 10 ms): a
stream or a batch result with exactly max_tokens of them and no error lost and repeated
nothing. The drain grace is 1 s, shorter than the long streams and the batch's requests:
a drain lets the short ones end and moves the long ones. The replicas have 8 sequence
slots each, so that the batch's depth (its requests in flight) is small enough to see
follow the fleet: 16 on 2 replicas, 32 on 4.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from support.fleet_load import FleetWatch, StreamLoad, paths
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server, wait_until
from support.ray_cluster import RayTestCluster, fleet_rows, ray_cluster, wait_fleet_ready

from tokenfleet.cli.main import main

pytestmark = pytest.mark.fake("runner")

FIXED = " a"  # the fixed runner's token, as text
STEP_S = "0.01"
GRACE_S = "1"
SEQS = 8  # sequence slots per replica: the batch depth is SEQS per replica taking work
# The batch: requests of 1 s at least (past the grace), enough of them to run from before
# the scale-up until after the scale-down.
BATCH_REQUESTS, BATCH_TOKENS = 300, 100
# Each worker of the load runs one stream after another: most long (5 s at least, past
# the grace), some short (ending within it).
LONG, SHORT = 500, 30
WORKER_TOKENS = [LONG] * 6 + [SHORT] * 2
SETTLE_S = 120.0  # bounds that only a hang reaches
ENDED = ("completed", "failed", "expired", "cancelled")  # an OpenAI batch's final states


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayTestCluster]:
    with ray_cluster(tmp_path_factory.mktemp("ray"), [4, 4]) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(
    cluster: RayTestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    args = ["--runner", "fixed", "--fixed-step-time", STEP_S, "--ray-address", cluster.address]
    args += ["--replicas", "2", "--drain-grace", GRACE_S, "--max-num-seqs", str(SEQS)]
    with live_server(tmp_path_factory.mktemp("gateway"), *args) as server:
        wait_fleet_ready(server, 2)
        yield server


def plan(worker: int, n: int) -> tuple[int, dict[str, Any]]:
    """Worker w's streams: WORKER_TOKENS[w] tokens each, labelled by that count."""
    max_tokens = WORKER_TOKENS[worker]
    content = f"Stream {worker}.{n}"
    messages = [{"role": "user", "content": content}]
    return max_tokens, {"messages": messages, "max_tokens": max_tokens, "temperature": 0}


def admin(server: LiveServer) -> dict[str, Any]:
    reply = httpx.get(f"{server.url}/admin/fleet", timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def metric(server: LiveServer, name: str, labels: str = "") -> float:
    """A series of /metrics: `labels` as the exposition writes them (`{class="batch"}`)."""
    text = httpx.get(f"{server.url}/metrics", timeout=HTTP_TIMEOUT_S).text
    series = name + labels + " "
    (value,) = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(series)]
    return value


def batch_in_engines(server: LiveServer) -> float:
    """Batch requests running or waiting in the ready replicas, as they last reported."""
    by_class = '{class="batch"}'
    running = metric(server, "tokenfleet_num_requests_running_by_class", by_class)
    return running + metric(server, "tokenfleet_num_requests_waiting_by_class", by_class)


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
    )


def create_batch(server: LiveServer) -> str:
    """The batch, through the Files and Batches API; its id."""
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Batch question {i}?"}],
                "max_tokens": BATCH_TOKENS,
                "temperature": 0,
            },
        }
        for i in range(BATCH_REQUESTS)
    ]
    client = openai_client(server)
    jsonl = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("scale.jsonl", jsonl), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "in_progress", batch
    return batch.id


def test_a_bad_scale_body_is_a_400_naming_replicas_and_changes_nothing(
    gateway: LiveServer,
) -> None:
    url = f"{gateway.url}/admin/fleet/scale"
    for body in ({"replicas": 0}, {"replicas": 2000}, {"replicas": "3"}, {"replicas": 1.5}, {}):
        reply = httpx.post(url, json=body, timeout=HTTP_TIMEOUT_S)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "replicas"), body
    reply = httpx.post(url, json={"replicas": 3, "nodes": 2}, timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "nodes"
    assert admin(gateway)["target_replicas"] is None
    assert [row["state"] for row in wait_fleet_ready(gateway, 2)] == ["ready"] * 2


def test_scale_2_to_4_to_2_under_streams_and_a_batch_loses_nothing_and_reports_each_drain(
    gateway: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under a steady load of 8 streams at a time and a batch of 300 requests: replicas 2
    and 3 pass starting -> ready, take streams and batch work, then draining -> gone,
    while 0 and 1 stay ready throughout. The batch's depth follows the fleet: on 4
    replicas more of its requests are in the engines than 2 replicas' depth allows. Every
    stream has exactly its max_tokens and no error (no 5xx); every custom_id of the batch
    has exactly one result, succeeded with its max_tokens; each drain is in GET
    /admin/fleet with its time and moves, and /metrics counts the same."""
    wait_fleet_ready(gateway, 2)
    client = openai_client(gateway)
    watch = FleetWatch(gateway)
    load = StreamLoad(gateway, len(WORKER_TOKENS), plan)
    try:
        wait_until(lambda: len(load.outcomes) >= 4, SETTLE_S, "the load under way")
        batch_id = create_batch(gateway)
        wait_until(lambda: batch_in_engines(gateway) > 0, SETTLE_S, "the batch under way")
        assert main(["fleet", "scale", "4", "--url", gateway.url]) == 0
        out = capsys.readouterr().out
        assert "scaling to 4 replicas: added [2, 3], kept [], draining []" in out
        wait_fleet_ready(gateway, 4, timeout=SETTLE_S)
        # The depth read at each lease: past what 2 replicas' sequence slots allow.
        filled = wait_until(
            lambda: (n := batch_in_engines(gateway)) > 2 * SEQS and n,
            SETTLE_S,
            "the batch filling 4 replicas",
        )

        def both_busy() -> bool:
            rows = {row["id"]: row for row in fleet_rows(gateway)}
            return all(rows[i]["requests_from_this_gateway"] >= 2 for i in (2, 3))

        wait_until(both_busy, SETTLE_S, "replicas 2 and 3 serving streams and the batch")
        before_drain = client.batches.retrieve(batch_id)
        reply = httpx.post(
            f"{gateway.url}/admin/fleet/scale", json={"replicas": 2}, timeout=HTTP_TIMEOUT_S
        )
        assert reply.status_code == 202, reply.text
        assert reply.json() == {"replicas": 2, "added": [], "kept": [], "draining": [3, 2]}
        # Else the drains could not have met the batch: it must be longer.
        assert before_drain.status == "in_progress", before_drain

        def drained() -> bool:
            body = admin(gateway)
            done = {d["id"] for d in body["drains"] if d["state"] == "stopped"}
            return done == {2, 3} and [r["id"] for r in body["replicas"]] == [0, 1]

        wait_until(drained, SETTLE_S, "replicas 2 and 3 drained and gone")
        count = len(load.outcomes)
        wait_until(lambda: len(load.outcomes) >= count + 8, SETTLE_S, "more streams after it")
        done = wait_until(
            lambda: (b := client.batches.retrieve(batch_id)).status in ENDED and b,
            SETTLE_S,
            "the batch ended",
        )
    finally:
        load.stop()
        seen = paths(watch.stop())
    assert seen == {
        0: ["ready"],
        1: ["ready"],
        2: ["starting", "ready", "draining", "gone"],
        3: ["starting", "ready", "draining", "gone"],
    }
    bad = [
        o
        for o in load.outcomes
        if (o.error, o.text, o.finish_reasons, o.completion_tokens)
        != (None, FIXED * o.label, ["length"], o.label)
    ]
    assert bad == [] and len(load.outcomes) >= 20, bad

    assert (done.status, done.error_file_id) == ("completed", None), done
    assert done.request_counts is not None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (BATCH_REQUESTS, BATCH_REQUESTS, 0)
    assert done.output_file_id is not None
    content = client.files.content(done.output_file_id).content.decode()
    results = [json.loads(line) for line in content.splitlines()]
    # Each custom_id exactly once, in input order; each a 200 with the fixed answer.
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(BATCH_REQUESTS)]
    wrong = [
        r
        for r in results
        if r["error"] is not None
        or r["response"]["status_code"] != 200
        or r["response"]["body"]["choices"][0]["message"]["content"] != FIXED * BATCH_TOKENS
        or r["response"]["body"]["choices"][0]["finish_reason"] != "length"
        or r["response"]["body"]["usage"]["completion_tokens"] != BATCH_TOKENS
    ]
    assert wrong == [], wrong[:3]
    # Committed once each: a second run's result would have been refused, not counted.
    succeeded = metric(gateway, "tokenfleet_batch_results_total", '{outcome="succeeded"}')
    assert succeeded == BATCH_REQUESTS
    print(
        f"\nbatch: {BATCH_REQUESTS} results; {filled:.0f} of them in the engines on 4 replicas "
        f"(2 replicas' depth: {2 * SEQS}); streams: {len(load.outcomes)}"
    )

    body = admin(gateway)
    assert body["target_replicas"] == 2 and body["drain_grace_s"] == float(GRACE_S)
    drains = {d["id"]: d for d in body["drains"]}
    assert set(drains) == {2, 3}
    assert all(d["state"] == "stopped" and d["asked_here"] for d in drains.values())
    print(
        "\ndrains: "
        + ", ".join(
            f"replica {i}: {d['seconds']:.3f} s, {d['moved']} moved" for i, d in drains.items()
        )
    )
    # Each drain took at least until its last stream ended or moved, within the grace
    # plus the settling bound; the long streams and batch requests it held moved (none
    # failed).
    assert all(0 < d["seconds"] < float(GRACE_S) + 5 + 2 for d in drains.values()), drains
    moved = sum(d["moved"] for d in drains.values())
    assert moved >= 1, drains
    assert body["moves"] == 0  # no death: drains are not failover moves
    assert metric(gateway, "tokenfleet_fleet_drain_seconds_count") == 2
    total = metric(gateway, "tokenfleet_fleet_drain_seconds_sum")
    assert abs(total - sum(d["seconds"] for d in drains.values())) < 0.002
    assert metric(gateway, "tokenfleet_fleet_drain_moves_total") == moved
    assert metric(gateway, "tokenfleet_fleet_replicas_draining") == 0
