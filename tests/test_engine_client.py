"""The engine in its own process: requests over ZMQ, outputs per step, aborts, and a
restart after the process is killed with a real signal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import pytest

from tokenfleet import LLM, SamplingParams
from tokenfleet.config import CacheConfig, EngineConfig
from tokenfleet.engine_client import AsyncEngineClient, EngineDeadError
from tokenfleet.errors import InvalidRequestError
from tokenfleet.outputs import EngineCoreOutput, EngineCoreRequest

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
            for _ in range(100):
                await asyncio.sleep(0.05)
                if client.stats and client.stats.num_running == 0:
                    break
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
            for _ in range(100):
                await asyncio.sleep(0.05)
                if client.stats and client.stats.num_running == 0:
                    break
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
