"""Fault paths of the engine client with a real engine process and real signals: an engine
that hangs (SIGSTOP: alive, but silent) is found by the heartbeat timeout, killed and
replaced, and the client serves again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from support.live_server import process_is_gone

from tokenfleet import SamplingParams
from tokenfleet.config import CacheConfig, EngineConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.engine.client import AsyncEngineClient, EngineDeadError

pytestmark = pytest.mark.slow

PROMPT = [1, 9690, 198, 2683, 314, 253, 5356, 30]
HEARTBEAT_TIMEOUT_S = 5.0  # short, yet far above an idle engine's 0.5 s heartbeat


async def _collect(client: AsyncEngineClient, req_id: str, n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    tokens: list[int] = []
    async for out in client.generate(EngineCoreRequest(req_id, PROMPT, params, 0.0)):
        tokens += out.new_token_ids
    return tokens


def test_a_hung_engine_is_killed_on_heartbeat_timeout_and_replaced(model_folder: Path) -> None:
    config = EngineConfig(model=str(model_folder), cache=CacheConfig(kv_cache_memory=32 << 20))

    async def main() -> None:
        client = AsyncEngineClient(config, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        await client.start()
        old_pid = client.pid
        assert old_pid is not None
        try:
            params = SamplingParams(max_tokens=700, temperature=0, ignore_eos=True)
            stream = client.generate(EngineCoreRequest("hung", PROMPT, params, 0.0))
            assert (await anext(stream)).new_token_ids  # running when the engine stops
            os.kill(old_pid, signal.SIGSTOP)
            stopped = time.monotonic()
            # The stream fails (it does not hang with the engine) once the heartbeat is late.
            with pytest.raises(EngineDeadError):
                async with asyncio.timeout(HEARTBEAT_TIMEOUT_S + 60):
                    async for _ in stream:
                        pass
            assert time.monotonic() - stopped >= HEARTBEAT_TIMEOUT_S - 1  # not before
            assert not client.is_healthy()
            assert process_is_gone(old_pid)  # the stopped process was killed, not left behind
            await client.wait_ready(180)
            assert client.is_healthy()
            assert client.pid not in (None, old_pid)
            assert client.num_restarts == 1
            assert len(await _collect(client, "after", 5)) == 5
        finally:
            if not process_is_gone(old_pid):
                os.kill(old_pid, signal.SIGKILL)
            await client.shutdown()

    asyncio.run(main())


def test_the_client_shuts_down_an_engine_that_hangs(model_folder: Path) -> None:
    """A shutdown does not wait forever on a stopped engine: it kills it."""
    config = EngineConfig(model=str(model_folder), cache=CacheConfig(kv_cache_memory=32 << 20))

    async def main() -> None:
        client = AsyncEngineClient(config, heartbeat_timeout_s=600)
        await client.start()
        pid = client.pid
        assert pid is not None
        try:
            os.kill(pid, signal.SIGSTOP)
            async with asyncio.timeout(60):
                await client.shutdown()
            deadline = time.monotonic() + 30
            while not process_is_gone(pid):
                assert time.monotonic() < deadline, f"engine {pid} outlived its shutdown"
                await asyncio.sleep(0.05)
        finally:
            if not process_is_gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    asyncio.run(main())
