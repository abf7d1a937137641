"""A request's failure stays its own (issue 29, point 2): values that break its sampling,
its logprobs, its decoding in the engine or its encoding on either side end that request
with an error, while the requests beside it (in the same message, the same step) go on with
exactly the tokens they get without it, and the engine process stays up. And the engine's
restarts back off, and an engine that hangs while starting is killed (point 6).

Reproductions (before this change each one made the engine process raise and exit, or lost
the requests sent with it): temperature 1e-300 or NaN (softmax of infinities, then an index
past the vocabulary in the inverse CDF), top_k 2**63 (over int64), a request whose fields
fail the engine's decoding (the whole AddRequests failed to decode), and seed 2**64 (the
gateway's encoder raised in a callback: every request of that turn waited forever)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import torch

from tokenfleet import SamplingParams
from tokenfleet.config import CacheConfig, EngineConfig
from tokenfleet.core.engine_api import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from tokenfleet.engine.client import AsyncEngineClient, EngineDeadError, RequestFailedError
from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.process import encode_step
from tokenfleet.engine.wire import StepOutputs
from tokenfleet.errors import InvalidRequestError
from tokenfleet.policy.step_model import StepModelConfig
from tokenfleet.runner.sampler import sample_rows

pytestmark = pytest.mark.slow

PROMPTS = [[1, 9690, 198, 2683, 314, 253, 5356, 30], [1, 4093, 198, 19842, 2]]
N = 4  # tokens per good request: enough to share several steps with the bad ones

GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=N, temperature=0.8, top_k=50, seed=1234, ignore_eos=True)


def _good() -> list[EngineCoreRequest]:
    return [
        EngineCoreRequest("greedy0", PROMPTS[0], GREEDY, 0.0),
        EngineCoreRequest("greedy1", PROMPTS[1], GREEDY, 0.0),
        EngineCoreRequest("seeded", PROMPTS[0], SEEDED, 0.0),
    ]


def _forced(params: SamplingParams, **fields: object) -> SamplingParams:
    """Params with values their own checks refuse: what a codec or validation bug would
    let through."""
    for name, value in fields.items():
        msgspec.structs.force_setattr(params, name, value)
    return params


def _config(folder: Path) -> EngineConfig:
    return EngineConfig(model=str(folder), cache=CacheConfig(kv_cache_memory=32 << 20))


@contextlib.asynccontextmanager
async def _running(client: AsyncEngineClient) -> AsyncIterator[AsyncEngineClient]:
    await client.start()
    try:
        yield client
    finally:
        await client.shutdown()


async def _tokens(client: AsyncEngineClient, request: EngineCoreRequest) -> list[int] | Exception:
    tokens: list[int] = []
    try:
        outputs = await client.submit(request)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                tokens += out.new_token_ids
    except (RequestFailedError, InvalidRequestError, EngineDeadError) as exc:
        return exc
    return tokens


def test_bad_sampling_values_fail_their_requests_alone_in_a_live_engine(model_folder: Path) -> None:
    """Submitted in one turn (one AddRequests, the same steps) beside good greedy and seeded
    requests: each bad one fails with its own error, the good ones' tokens are those of a
    run without the bad ones, the engine process is the same, and every block is freed.

    Then the engine is killed (SIGKILL) and its replacement stopped (SIGSTOP) before it can
    say it is ready: that one is killed once the start timeout passes, and the next one
    starts after the second restart's backoff and serves the same tokens."""
    bad = {
        "tiny-temperature": SamplingParams(max_tokens=N, temperature=1e-300),
        "nan-temperature": SamplingParams(max_tokens=N, temperature=float("nan")),
        # Refused by the engine's decoding of this request alone (its own checks).
        "forced-top-k": _forced(SamplingParams(max_tokens=N), top_k=-7),
        # Past what msgpack holds: refused by the gateway's encoder, alone.
        "seed-2**64": SamplingParams(max_tokens=N, temperature=0.5, seed=2**64),
    }
    # Values that used to crash and are now served: a top_k past int64 keeps the vocabulary.
    served = {"top-k-2**63": SamplingParams(max_tokens=N, top_k=2**63, seed=7, ignore_eos=True)}

    async def main() -> None:
        client = AsyncEngineClient(_config(model_folder), restart_backoff_s=BACKOFF_S)
        async with _running(client):
            pid = client.pid
            alone = await asyncio.gather(*(_tokens(client, r) for r in _good()))
            assert all(isinstance(t, list) and len(t) == N for t in alone)
            # Bad first, so that the good ones ride in the same message after them.
            mixed = [EngineCoreRequest(k, PROMPTS[0], p, 0.0) for k, p in bad.items()]
            mixed += [EngineCoreRequest(k, PROMPTS[1], p, 0.0) for k, p in served.items()]
            mixed += _good()
            results = dict(
                zip(
                    [r.req_id for r in mixed],
                    await asyncio.gather(*(_tokens(client, r) for r in mixed)),
                    strict=True,
                )
            )
            for name in ("tiny-temperature", "nan-temperature"):
                assert isinstance(results[name], RequestFailedError), results[name]
                assert "not finite" in str(results[name])
            assert isinstance(results["forced-top-k"], InvalidRequestError)
            assert "top_k" in str(results["forced-top-k"])
            assert isinstance(results["seed-2**64"], InvalidRequestError)
            assert "cannot be sent to the engine" in str(results["seed-2**64"])
            assert isinstance(results["top-k-2**63"], list) and len(results["top-k-2**63"]) == N
            assert [results[r.req_id] for r in _good()] == alone
            assert client.pid == pid and client.num_restarts == 0 and client.is_healthy()
            deadline = time.monotonic() + 30
            while not (client.stats and client.stats.num_kv_blocks_used == 0):
                assert time.monotonic() < deadline, client.stats
                await asyncio.sleep(0.05)
            assert client.stats.num_running == client.stats.num_waiting == 0
            await _hang_on_restart(client)
            assert await _tokens(client, _good()[1]) == alone[1]

    asyncio.run(main())


START_TIMEOUT_S, BACKOFF_S = 4.0, 1.5


async def _hang_on_restart(client: AsyncEngineClient) -> None:
    first = client.pid
    assert first is not None
    client.startup_timeout_s = START_TIMEOUT_S
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while client.pid == first:  # the first restart in a row: at once
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    hung = client.pid
    assert hung is not None
    os.kill(hung, signal.SIGSTOP)
    stopped = time.monotonic()
    while client.pid == hung:
        assert time.monotonic() < stopped + START_TIMEOUT_S + 30
        await asyncio.sleep(0.05)
    # Killed after the start timeout, replaced after the second restart's backoff.
    assert time.monotonic() - stopped >= START_TIMEOUT_S + BACKOFF_S - 0.5
    assert client.num_restarts == 2
    with contextlib.suppress(ProcessLookupError):
        os.kill(hung, 0)
        pytest.fail("the hung engine was left running")
    client.startup_timeout_s = 600
    await client.wait_ready(120)


@pytest.fixture(scope="module")
def core(model_folder: Path) -> EngineCore:
    return EngineCore(_config(model_folder), step_model_config=StepModelConfig(profile=False))


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int] | str]:
    """Each request's tokens, or its error, from an in-process engine."""
    for request in requests:
        core.add_request(request)
    got: dict[str, list[int] | str] = {r.req_id: [] for r in requests}
    while core.has_unfinished_requests() or core.has_pending_outputs():
        for out in core.step().outputs:
            if out.finish_reason == "error":
                got[out.req_id] = out.error or ""
            else:
                tokens = got[out.req_id]
                assert isinstance(tokens, list)
                tokens += out.new_token_ids
    return got


def test_a_failing_batched_sampler_is_redone_per_request_and_the_others_stay_exact(
    core: EngineCore,
) -> None:
    """Values that make the batched sampler or the logprobs raise (a logit_bias id of -1
    and a logprobs count past the vocabulary, let through by force: the engine process
    refuses them when decoding, an in-process engine takes them as they are): the step is
    sampled again row by row, only their requests fail, the others' tokens (greedy, and
    seeded: the redo reuses their draws) are exact."""
    alone = _run(core, _good())
    bias = _forced(SamplingParams(max_tokens=N, logit_bias=((5, 1.0),)), logit_bias=((-1, 1.0),))
    many = _forced(SamplingParams(max_tokens=N, temperature=0, logprobs=1), logprobs=10**6)
    bad = [
        EngineCoreRequest("bias-minus-1", PROMPTS[1], bias, 0.0),
        EngineCoreRequest("logprobs-10**6", PROMPTS[0], many, 0.0),
    ]
    renamed = [msgspec.structs.replace(r, req_id=r.req_id + "-again") for r in _good()]
    got = _run(core, bad + renamed)
    assert "sampling failed" in str(got["bias-minus-1"])
    assert "logprobs failed" in str(got["logprobs-10**6"])
    assert {k.removesuffix("-again"): v for k, v in got.items() if k.endswith("-again")} == alone
    assert core.kv.pool.num_used_blocks == 0 and not core.scheduler.requests


def test_an_output_that_cannot_be_encoded_fails_its_request_alone(core: EngineCore) -> None:
    """The engine's step message: an output the codec cannot hold (an integer past 64 bits)
    ends its request with an error output in its place; the others go out as they are."""
    for request in _good()[:2]:
        core.add_request(msgspec.structs.replace(request, req_id="enc-" + request.req_id))
    outputs = EngineCoreOutputs(
        [
            EngineCoreOutput("enc-greedy0", [17]),
            EngineCoreOutput("enc-greedy1", [2**70]),
        ],
        timestamp=1.0,
    )
    message = msgspec.msgpack.decode(
        encode_step(msgspec.msgpack.Encoder(), outputs, core.fail_requests), type=StepOutputs
    )
    by_id = {o.req_id: o for o in message.outputs.outputs}
    assert by_id["enc-greedy0"].new_token_ids == [17] and by_id["enc-greedy0"].error is None
    assert by_id["enc-greedy1"].finish_reason == "error"
    assert "could not be encoded" in (by_id["enc-greedy1"].error or "")
    assert set(core.scheduler.requests) == {"enc-greedy0"}  # the failed one is freed
    core.abort(["enc-greedy0"])
    core.step()


def test_sample_rows_keeps_a_failing_row_to_itself() -> None:
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0),
        _forced(SamplingParams(), logit_bias=((-1, 1.0),)),
        SamplingParams(temperature=0.7, seed=3),
    ]
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(3)]
    tokens, failed = sample_rows(logits, params, gens)
    assert tokens[1] is None and list(failed) == [1]
    alone, _ = sample_rows(logits[2:3], params[2:3], [torch.Generator().manual_seed(3)])
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == alone[0]


def test_restarts_back_off_exponentially_up_to_the_cap() -> None:
    client = AsyncEngineClient(EngineConfig(), restart_backoff_s=0.5, restart_backoff_max_s=3)
    delays = []
    for _ in range(6):
        delays.append(client.restart_delay())
        client._restarts_in_a_row += 1
    assert delays == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    client._ready_at = time.monotonic() - 3  # an engine that stayed up past the cap
    assert client.restart_delay() == 0.0
