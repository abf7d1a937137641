"""Crash safety of the Batch API with real processes and real signals: SIGKILL the gateway
process alone mid-batch (its engine process must die with it: nothing signals the engine)
and start the server again on the same store; SIGKILL only the engine process. Either way
the batch completes and every custom_id has exactly one result, equal to the sync API's
greedy output."""

from __future__ import annotations

import os
import signal
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import anthropic
import pytest
from support.live_server import MODEL, LiveServer, children, free_port, live_server, wait_gone

pytestmark = pytest.mark.slow

NUM_REQUESTS = 12
MAX_TOKENS = 24


def batch_requests() -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"crash-{i}",
            "params": {
                "model": MODEL,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            },
        }
        for i in range(NUM_REQUESTS)
    ]


def server_group(tmp: Path, data_dir: Path, port: int) -> AbstractContextManager[LiveServer]:
    """`tokenfleet serve` on a given port and store, so that a second one takes over."""
    return live_server(
        tmp, "--data-dir", str(data_dir), "--gateway-id", "crash-test-gateway", port=port
    )


def wait_for(client: anthropic.Anthropic, batch_id: str, done: int, timeout: float) -> Any:
    """The batch once at least `done` requests succeeded (or it ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended" or batch.request_counts.succeeded >= done:
            return batch
        time.sleep(0.1)
    raise TimeoutError(f"{batch_id}: fewer than {done} results in {timeout}s")


def check_exactly_one_greedy_result_each(client: anthropic.Anthropic, batch_id: str) -> None:
    batch = wait_for(client, batch_id, NUM_REQUESTS + 1, timeout=300)
    assert batch.processing_status == "ended"
    assert batch.request_counts.succeeded == NUM_REQUESTS, batch.request_counts
    lines = list(client.messages.batches.results(batch_id))
    assert sorted(r.custom_id for r in lines) == sorted(r["custom_id"] for r in batch_requests())
    by_id = {r.custom_id: r.result for r in lines}
    for request in batch_requests()[:4]:  # the sync API agrees, token for token
        p = request["params"]
        sync = client.messages.create(
            model=MODEL,
            max_tokens=p["max_tokens"],
            messages=p["messages"],
            extra_body={"temperature": 0},
        )
        result = by_id[request["custom_id"]]
        assert result.type == "succeeded"
        assert result.message.content[0].text == sync.content[0].text
        assert result.message.usage.output_tokens == sync.usage.output_tokens


def test_sigkill_of_the_gateway_alone_mid_batch_takes_its_engine_then_restart_on_the_same_store(
    tmp_path: Path,
) -> None:
    """Only the gateway is killed, not the process group: the engine, left without its
    parent, must end by itself (the engine process asks the kernel for SIGKILL when its
    parent dies, PR_SET_PDEATHSIG) instead of holding its memory and cores."""
    data_dir, port = tmp_path / "data", free_port()
    with server_group(tmp_path, data_dir, port) as first:
        client = anthropic.Anthropic(base_url=first.url, api_key="unused", max_retries=0)
        batch = client.messages.batches.create(requests=batch_requests())
        partway = wait_for(client, batch.id, 2, timeout=120)
        assert partway.processing_status == "in_progress", "killed too late to mean anything"
        gateway_pid = first.process.pid
        engine_pid = first.engine_pid()
        assert engine_pid in children(gateway_pid)  # the engine is the gateway's child
        os.kill(gateway_pid, signal.SIGKILL)  # the gateway alone, not the group
        first.process.wait()
        # The kernel kills the orphan at once; the bound is generous only for a slow machine.
        assert wait_gone(engine_pid, timeout=30), "the engine outlived its killed gateway"
    with server_group(tmp_path, data_dir, port) as second:
        client = anthropic.Anthropic(base_url=second.url, api_key="unused", max_retries=0)
        check_exactly_one_greedy_result_each(client, batch.id)


def test_sigkill_of_the_engine_alone_mid_batch(tmp_path: Path) -> None:
    with server_group(tmp_path, tmp_path / "data", free_port()) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        batch = client.messages.batches.create(requests=batch_requests())
        partway = wait_for(client, batch.id, 2, timeout=120)
        assert partway.processing_status == "in_progress", "killed too late to mean anything"
        old_pid = server.engine_pid()
        os.kill(old_pid, signal.SIGKILL)
        check_exactly_one_greedy_result_each(client, batch.id)
        assert server.engine_pid() != old_pid  # the gateway started a new engine by itself
