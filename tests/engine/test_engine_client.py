"""The engine in its own process: requests over ZMQ, outputs per step, aborts, and a
restart after the process is killed with a real signal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import zmq

from tokenfleet import LLM, SamplingParams
from tokenfleet.config import CacheConfig, EngineConfig
from tokenfleet.core.engine_api import EngineCoreOutput, EngineCoreRequest
from tokenfleet.engine.client import AsyncEngineClient, EngineDeadError
from tokenfleet.engine.process import (
    ARRIVAL_GAP_MS,
    ARRIVAL_WINDOW_MAX_S,
    ARRIVAL_WINDOW_STEP_SHARE,
    BURST_GAP_MS,
    arrival_gap_ms,
)
from tokenfleet.engine.wire import AbortRequests, AddRequests, EngineInput
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server.service import PendingRequests

PROMPTS = [[1, 9690, 198, 2683, 314, 253, 5356, 30], [1, 4093, 198, 19842, 2]]


def _config(folder: Path) -> EngineConfig:
    return EngineConfig(model=str(folder), cache=CacheConfig(kv_cache_memory=32 << 20))


@contextlib.asynccontextmanager
async def _running(folder: Path) -> AsyncIterator[AsyncEngineClient]:
    client = AsyncEngineClient(_config(folder))
    await client.start()
    try:
        yield client
    finally:
        await client.shutdown()


async def _collect(client: AsyncEngineClient, req_id: str, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    tokens: list[int] = []
    async for out in client.generate(EngineCoreRequest(req_id, prompt, params, 0.0)):
        tokens += out.new_token_ids
    return tokens


async def _until(condition: Callable[[], bool], timeout: float = 60) -> None:
    """Poll `condition` until it holds; fail after `timeout` seconds (generous: a slow
    machine only makes it take longer)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not true after {timeout} s"
        await asyncio.sleep(0.02)


def _idle(client: AsyncEngineClient) -> bool:
    return client.stats is not None and client.stats.num_running == 0


async def _start_long_stream(
    client: AsyncEngineClient, req_id: str, max_tokens: int
) -> AsyncGenerator[EngineCoreOutput, None]:
    """A stream that has produced its first tokens and has many more to go."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    stream = client.generate(EngineCoreRequest(req_id, PROMPTS[0], params, 0.0))
    first = await anext(stream)
    assert first.new_token_ids
    return stream


def test_engine_process_streams_the_same_tokens_as_in_process(model_folder: Path) -> None:
    expected = [
        o.token_ids
        for o in LLM(str(model_folder), kv_cache_memory=32 << 20).generate(
            PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )
    ]

    async def main() -> None:
        async with _running(model_folder) as client:
            assert client.is_healthy() and client.info is not None
            assert client.info.num_kv_blocks == 45  # 32 MiB of 737,280-byte blocks
            assert client.info.max_model_len == 45 * 16
            got = await asyncio.gather(
                *(_collect(client, f"r{i}", p, 12) for i, p in enumerate(PROMPTS))
            )
            assert list(got) == expected
            with pytest.raises(InvalidRequestError, match="prompt must contain at least one"):
                await _collect(client, "empty", [], 4)
            assert await _collect(client, "after", PROMPTS[0], 12) == expected[0]

    asyncio.run(main())


def test_abandoned_stream_is_aborted_and_frees_blocks(model_folder: Path) -> None:
    async def main() -> None:
        async with _running(model_folder) as client:
            stream = await _start_long_stream(client, "long", 500)
            await stream.aclose()  # what a client disconnect does to the handler
            await _until(lambda: _idle(client))
            assert client.stats is not None
            assert client.stats.num_running == 0
            assert client.stats.num_kv_blocks_used == 0

    asyncio.run(main())


def test_submitted_request_closed_before_any_output_is_aborted(model_folder: Path) -> None:
    """A streamed reply starts once the engine has the request; a client gone before the
    first token closes outputs never read, and that still aborts the request."""

    async def main() -> None:
        async with _running(model_folder) as client:
            params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
            outputs = await client.submit(EngineCoreRequest("early", PROMPTS[0], params, 0.0))
            with pytest.raises(InvalidRequestError, match="'early' is in use"):
                await client.submit(EngineCoreRequest("early", PROMPTS[1], params, 0.0))
            await outputs.aclose()
            with pytest.raises(StopAsyncIteration):
                await anext(outputs)
            await _until(lambda: _idle(client))
            assert client.stats is not None
            assert (client.stats.num_running, client.stats.num_waiting) == (0, 0)
            assert client.stats.num_kv_blocks_used == 0
            # The id is free again, and a request under it runs to its end.
            assert len(await _collect(client, "early", PROMPTS[1], 3)) == 3

    asyncio.run(main())


def test_killed_engine_fails_streams_and_is_restarted(model_folder: Path) -> None:
    async def main() -> None:
        async with _running(model_folder) as client:
            stream = await _start_long_stream(client, "doomed", 700)
            old_pid = client.pid
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert not client.is_healthy()
            await client.wait_ready(120)
            assert client.is_healthy() and client.pid != old_pid
            assert client.num_restarts == 1
            assert len(await _collect(client, "again", PROMPTS[1], 5)) == 5

    asyncio.run(main())


@pytest.mark.parametrize(
    ("arrivals", "num_pending", "window_left_ms", "announced", "counted_after_poll", "gap_ms"),
    [
        (1, None, 50.0, False, False, ARRIVAL_GAP_MS),  # a lone request, the sender cannot tell
        (2, None, 50.0, False, False, BURST_GAP_MS),  # a burst under way: a pause may split it
        (2, 0, 50.0, False, False, BURST_GAP_MS),  # no more seen: some may not have been read yet
        (1, 0, 50.0, False, False, ARRIVAL_GAP_MS),
        (1, 0, 50.0, False, True, ARRIVAL_GAP_MS),  # (the client may have stalled after one)
        (1, 3, 50.0, False, False, 50),  # ...or that more are coming: the rest of the window
        (1, 3, 12.2, False, False, 13),
        (1, 3, 0.3, False, True, 1),
        (32, 0, 40.0, True, False, ARRIVAL_GAP_MS),  # the burst the sender announced is in
        (32, 0, 40.0, True, True, 0),  # ...counted after a fresh poll of its sockets: go
        (32, None, 40.0, True, False, BURST_GAP_MS),  # (a sender that cannot tell: as before)
        (5, 2, 40.0, True, True, 40),
    ],
)
def test_an_idle_engine_waits_for_what_the_sender_says_is_on_its_way(
    arrivals: int,
    num_pending: int | None,
    window_left_ms: float,
    announced: bool,
    counted_after_poll: bool,
    gap_ms: int,
) -> None:
    assert (
        arrival_gap_ms(arrivals, num_pending, window_left_ms, announced, counted_after_poll)
        == gap_ms
    )


def test_a_request_on_its_way_joins_the_first_step(model_folder: Path) -> None:
    """An idle engine told that another request is on its way (AddRequests.num_pending)
    waits for it within its arrival window and starts one step with both; told that none
    is, it waits only ARRIVAL_GAP_MS, and a request sent later within the window gets a step
    of its own. Outputs of one step share their `arrived`.

    The window is a time: the engine's own behaviour, min(ARRIVAL_WINDOW_MAX_S,
    ARRIVAL_WINDOW_STEP_SHARE x its last step). The second request is sent at a point
    inside it with wide margins on both sides, placed from the window this run's last step
    gives: a quarter of the way in when it is announced (it must come before the window
    ends), half way in when it is not (it must come after the ARRIVAL_GAP_MS gap)."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def same_first_step(client: AsyncEngineClient, num_pending: int) -> bool:
        # A long prefill (a prompt of its own: no prefix-cache hit) is the engine's last step.
        started = time.monotonic()
        await _collect(client, f"long-{num_pending}", [100 + num_pending] * 400, 1)
        step_s = time.monotonic() - started  # one step, and the way there and back
        window_s = min(ARRIVAL_WINDOW_MAX_S, ARRIVAL_WINDOW_STEP_SHARE * step_s)
        assert window_s >= 0.02, f"a {step_s:.3f} s step gives no window to place a request in"
        first = await client.submit(
            EngineCoreRequest(f"a{num_pending}", PROMPTS[0], params, 0.0), num_pending
        )
        await asyncio.sleep(window_s / 4 if num_pending else window_s / 2)
        second = await client.submit(
            EngineCoreRequest(f"b{num_pending}", PROMPTS[1], params, 0.0), 0
        )
        async with contextlib.aclosing(first), contextlib.aclosing(second):
            await anext(first)
            await anext(second)
            return first.arrived == second.arrived

    async def main() -> None:
        async with _running(model_folder) as client:
            assert await same_first_step(client, num_pending=1)
            assert not await same_first_step(client, num_pending=0)

    asyncio.run(main())


def test_pending_requests_counts_the_server_requests_not_yet_at_the_engine() -> None:
    async def main() -> None:
        tasks: set[asyncio.Task[None]] = set()  # as uvicorn keeps its request tasks
        way = PendingRequests(tasks)
        counts: dict[str, int | None] = {}
        done = asyncio.Event()

        async def work(name: str) -> None:  # in a task of its own, as n > 1 choices are
            counts[name] = way.reached()

        async def request(name: str, submits: bool) -> None:
            way.entered()
            if submits:
                await asyncio.create_task(work(name))
            else:
                way.passed()  # a route that never reaches the engine
            await done.wait()

        def start(name: str, submits: bool = True) -> None:
            task = asyncio.create_task(request(name, submits))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        for name in ("a", "b", "metrics", "c"):
            start(name, submits=name != "metrics")
        while len(counts) < 3:  # all four entered, then each submitted in turn
            await asyncio.sleep(0)
        assert counts == {"a": 2, "b": 1, "c": 0}
        assert way.count() == 0  # (as the engine client counts at the end of a turn)
        start("d")
        start("e")
        assert way.count() == 2  # taken in, not run yet
        while len(counts) < 5:
            await asyncio.sleep(0)
        assert counts["d"] == 1 and counts["e"] == 0
        running = list(tasks)
        done.set()
        await asyncio.gather(*running)
        assert not tasks
        assert way.reached() == 0  # not a server request (the batch dispatcher): not counted
        assert PendingRequests(None).reached() is None  # a server that does not expose its tasks
        assert PendingRequests(None).count() is None

    asyncio.run(main())


@pytest.mark.fake("engine")
def test_requests_submitted_in_one_turn_reach_a_fake_engine_in_two_messages(
    model_folder: Path,
) -> None:
    """A turn of the event loop's first request goes at once (the engine starts its arrival
    window on it, told how many are on their way); the turn's later ones go together two
    turns later, in order, once the loop has polled its sockets again; an abort in the same
    turn goes after the requests it may name. With the gateway's count (count_pending),
    the later message carries the count made then, `counted_after_poll`, and goes even with no
    request when the last message said some were coming. The engine's end of the socket is read
    here (no engine process)."""
    params = SamplingParams(max_tokens=2, temperature=0)
    decoder = msgspec.msgpack.Decoder(EngineInput)

    async def main() -> None:
        client = AsyncEngineClient(_config(model_folder))
        engine_end = zmq.Context.instance().socket(zmq.PULL)
        engine_end.bind("inproc://tokenfleet-test-turns")
        client._input = zmq.Context.instance().socket(zmq.PUSH)
        client._input.connect("inproc://tokenfleet-test-turns")
        client.is_healthy = lambda: True  # type: ignore[method-assign]

        def received() -> list[tuple[str, list[str], int | None, bool]]:
            out = []
            while engine_end.poll(100):
                message = decoder.decode(engine_end.recv())
                if isinstance(message, AddRequests):
                    ids = [r.req_id for r in message.requests]
                    out.append(("add", ids, message.num_pending, message.counted_after_poll))
                elif isinstance(message, AbortRequests):
                    out.append(("abort", message.req_ids, None, False))
            return out

        async def two_turns() -> None:
            await asyncio.sleep(0)
            assert received() == []  # not yet: the loop has not polled its sockets again
            await asyncio.sleep(0)

        try:
            for i in range(4):
                await client.submit(EngineCoreRequest(f"r{i}", PROMPTS[0], params, 0.0), 3 - i)
            assert received() == [("add", ["r0"], 3, False)]  # the rest wait
            await two_turns()
            assert received() == [("add", ["r1", "r2", "r3"], 0, False)]  # no count: unchecked
            await client.submit(EngineCoreRequest("r4", PROMPTS[0], params, 0.0))
            await client.submit(EngineCoreRequest("r5", PROMPTS[0], params, 0.0))
            await client.abort(["r5"])
            assert received() == [
                ("add", ["r4"], None, False),
                ("add", ["r5"], None, False),
                ("abort", ["r5"], None, False),
            ]
            await two_turns()
            assert received() == []

            seen = [2]  # the gateway's count when the loop gets round to it
            client.count_pending = lambda: seen[0]
            await client.submit(EngineCoreRequest("r6", PROMPTS[0], params, 0.0), 0)
            await client.submit(EngineCoreRequest("r7", PROMPTS[0], params, 0.0), 0)
            assert received() == [("add", ["r6"], 0, False)]
            await two_turns()
            assert received() == [("add", ["r7"], 2, True)]  # two more came meanwhile
            seen[0] = 0
            await client.submit(EngineCoreRequest("r8", PROMPTS[0], params, 0.0), 1)
            assert received() == [("add", ["r8"], 1, False)]
            await two_turns()  # the one on its way failed its checks: none is any more
            assert received() == [("add", [], 0, True)]
            await client.submit(EngineCoreRequest("r9", PROMPTS[0], params, 0.0), 0)
            assert received() == [("add", ["r9"], 0, False)]
            await two_turns()  # the engine was told 0 already: nothing more to say
            assert received() == []
        finally:
            client._input.close(linger=0)
            engine_end.close(linger=0)
            client._ctx.destroy(linger=0)

    asyncio.run(main())
