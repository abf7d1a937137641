"""A request resumed from an earlier attempt's outputs (EngineCoreRequest.output_token_ids)
goes on exactly as the stream that never moved: greedy and seeded (draws keyed by seed and
output position) alike, with penalties, batched with others, preempted and recomputed, up
to the same stop or length. What a resume cannot be is refused, naming the param."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest
import torch
from support.engine_streams import Stream, run_streams

from tokenfleet import SamplingParams
from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.config import CacheConfig, EngineConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.engine.core import EngineCore
from tokenfleet.errors import ContextLengthError, InvalidRequestError
from tokenfleet.models.config import ModelConfig
from tokenfleet.policy.step_model import StepModelConfig
from tokenfleet.runner.sampler import sample_rows, seeded_uniform

N = 24  # tokens of the unmoved stream
K = 9  # tokens the first attempt sent before its replica died
BLOCK_SIZE = 16
NUM_BLOCKS = 20  # room for a few requests at once: eight of them preempt each other

GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=N, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
PENALIZED = SamplingParams(
    max_tokens=N,
    temperature=0.9,
    top_p=0.95,
    seed=11,
    ignore_eos=True,
    frequency_penalty=0.8,
    presence_penalty=0.5,
    logprobs=2,
)


@pytest.fixture(scope="module")
def core(model_folder: Path) -> EngineCore:
    kv_bytes = ModelConfig.from_folder(model_folder).kv_bytes_per_token(4)  # float32
    cache = CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=kv_bytes * BLOCK_SIZE * NUM_BLOCKS)
    engine = EngineCore(
        EngineConfig(model=str(model_folder), cache=cache),
        step_model_config=StepModelConfig(profile=False),
    )
    assert engine.runner.num_blocks == NUM_BLOCKS
    return engine


@pytest.fixture(scope="module")
def prompt(core: EngineCore) -> list[int]:
    return _chat(core, "Tell me a story about a lighthouse.")


def _chat(core: EngineCore, text: str) -> list[int]:
    tokenizer = Tokenizer(core.model_folder)
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


_ids = itertools.count()


def _request(
    prompt: list[int],
    params: SamplingParams,
    earlier: list[int] | None = None,
    arrival_time: float = 0.0,
) -> EngineCoreRequest:
    return EngineCoreRequest(
        f"r{next(_ids)}", prompt, params, arrival_time, output_token_ids=earlier or []
    )


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> list[Stream]:
    """Each request's stream, all added before the first step (batched together)."""
    streams = run_streams(core, requests)
    return streams


def _moved(core: EngineCore, prompt: list[int], params: SamplingParams) -> Stream:
    """The stream of a request whose first attempt stopped after K tokens, resumed."""
    (first,) = _run(core, [_request(prompt, _replace(params, max_tokens=K))])
    assert len(first.tokens) == K
    (resumed,) = _run(core, [_request(prompt, params, first.tokens)])
    return Stream(first.tokens + resumed.tokens, *resumed[1:])


def _replace(params: SamplingParams, **fields: object) -> SamplingParams:
    return msgspec.structs.replace(params, **fields)


@pytest.mark.parametrize(
    "params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"]
)
def test_a_resumed_stream_goes_on_token_for_token(
    core: EngineCore, prompt: list[int], params: SamplingParams
) -> None:
    """Greedy, seeded (temperature 0.9, top_p 0.95), and seeded with penalties (which see
    the earlier outputs as outputs): the 15 new tokens are tokens 9..23 of the unmoved
    stream, and it ends with "length" at the same total; logprobs come for the new tokens
    alone, the same as the unmoved stream's."""
    (unmoved,) = _run(core, [_request(prompt, params)])
    assert len(unmoved.tokens) == N and unmoved.finish_reason == "length"
    moved = _moved(core, prompt, params)
    assert moved.tokens == unmoved.tokens
    assert moved.finish_reason == "length" and moved.stop_token_id is None
    if params.logprobs is not None:
        assert [e.token_id for e in moved.logprobs] == unmoved.tokens[K:]
        assert [e.logprob for e in moved.logprobs] == pytest.approx(
            [e.logprob for e in unmoved.logprobs[K:]], abs=1e-4
        )
    if params is SEEDED:  # another seed is another stream: the seed is what keys the draws
        (other,) = _run(core, [_request(prompt, _replace(params, seed=8))])
        assert other.tokens != unmoved.tokens


def test_a_resumed_stream_ends_at_the_same_stop(core: EngineCore, prompt: list[int]) -> None:
    """EOS (greedy) and a stop_token_ids entry (seeded) in the continuation end it as they
    end the unmoved stream; a stop token among the earlier outputs is not checked again."""
    france = _chat(core, "What is the capital of France?")
    greedy = SamplingParams(max_tokens=64, temperature=0)
    (unmoved,) = _run(core, [_request(france, greedy)])
    assert unmoved.finish_reason == "stop" and unmoved.stop_token_id == 2
    assert len(unmoved.tokens) == 8  # the resume below leaves it 4 to go, EOS the last
    (first,) = _run(core, [_request(france, _replace(greedy, max_tokens=4))])
    (resumed,) = _run(core, [_request(france, greedy, first.tokens)])
    assert first.tokens + resumed.tokens == unmoved.tokens
    assert resumed.finish_reason == "stop" and resumed.stop_token_id == 2

    (free,) = _run(core, [_request(prompt, SEEDED)])
    stop_at = next(i for i in range(K + 3, N) if free.tokens[i] not in free.tokens[:i])
    stopping = _replace(SEEDED, stop_token_ids=(free.tokens[stop_at],))
    (unmoved,) = _run(core, [_request(prompt, stopping)])
    assert unmoved.tokens == free.tokens[: stop_at + 1] and unmoved.finish_reason == "stop"
    moved = _moved(core, prompt, stopping)
    assert moved == unmoved

    # A stop token that only the earlier outputs hold: the resume runs to length.
    earlier_only = next(t for t in free.tokens[:K] if t not in free.tokens[K:])
    (resumed,) = _run(
        core,
        [_request(prompt, _replace(SEEDED, stop_token_ids=(earlier_only,)), free.tokens[:K])],
    )
    assert resumed.tokens == free.tokens[K:] and resumed.finish_reason == "length"


def test_a_resumed_request_batched_with_others_gives_the_same_tokens(
    core: EngineCore, prompt: list[int]
) -> None:
    """Resumed greedy and seeded requests in the same steps as the unmoved seeded one and
    two fresh prompts: each resumed one gives the unmoved stream's tail, and the unmoved one
    beside them its own tokens."""
    (greedy,) = _run(core, [_request(prompt, GREEDY)])
    (seeded,) = _run(core, [_request(prompt, SEEDED)])
    others = [_chat(core, f"Count to {n}.") for n in (5, 6)]
    streams = _run(
        core,
        [
            _request(others[0], SamplingParams(max_tokens=N, temperature=0.8)),
            _request(prompt, GREEDY, greedy.tokens[:K]),
            _request(prompt, SEEDED),
            _request(prompt, SEEDED, seeded.tokens[:K]),
            _request(others[1], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)),
        ],
    )
    assert streams[1].tokens == greedy.tokens[K:] and streams[1].finish_reason == "length"
    assert streams[2].tokens == seeded.tokens
    assert streams[3].tokens == seeded.tokens[K:] and streams[3].finish_reason == "length"


def test_a_preempted_resumed_seeded_request_recomputes_to_the_same_tokens(
    core: EngineCore, prompt: list[int]
) -> None:
    """Eight requests that outgrow the cache: the resumed seeded one, the newest, is
    preempted, recomputed over its prompt and all its outputs, and still gives the tail."""
    (seeded,) = _run(core, [_request(prompt, SEEDED)])
    fresh = [
        _request(_chat(core, f"Name {n} rivers."), GREEDY, arrival_time=float(n))
        for n in range(2, 9)
    ]
    resumed = _request(prompt, SEEDED, seeded.tokens[:K], arrival_time=100.0)
    for request in [*fresh, resumed]:
        core.add_request(request)
    tokens: list[int] = []
    num_preemptions = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            if out.req_id == resumed.req_id:
                tokens += out.new_token_ids
        live = core.scheduler.requests.get(resumed.req_id)
        if live is not None:
            num_preemptions = live.num_preemptions
    assert num_preemptions > 0
    assert tokens == seeded.tokens[K:]


def test_what_a_resume_cannot_be_is_refused_naming_the_param(
    core: EngineCore, prompt: list[int]
) -> None:
    """Earlier outputs that already reach max_tokens, a resume asking for prompt_logprobs,
    earlier outputs outside the vocabulary, and a prompt + max_tokens (earlier outputs
    included) past the context: each refused, nothing left behind."""
    earlier = [504, 1977, 282]
    cases = [
        (_request(prompt, _replace(GREEDY, max_tokens=3), earlier), InvalidRequestError,
         "max_tokens", r"3 output tokens already reach max_tokens \(3\)"),
        (_request(prompt, _replace(GREEDY, prompt_logprobs=1), earlier), InvalidRequestError,
         "prompt_logprobs", "resumed request"),
        (_request(prompt, GREEDY, [504, 49152]), InvalidRequestError,
         "output_token_ids", r"token id 49152 is outside the vocabulary \[0, 49152\)"),
        (_request([100] * 300, GREEDY, earlier), ContextLengthError,
         "max_tokens", "plus max_tokens .24. is 324 tokens, over the context length of 320"),
    ]  # fmt: skip
    for request, error, param, message in cases:
        with pytest.raises(error, match=message) as info:
            core.add_request(request)
        assert info.value.param == param
    assert not core.scheduler.requests and not core.has_unfinished_requests()
    # The same resume within max_tokens is taken.
    (ok,) = _run(core, [_request(prompt, _replace(GREEDY, max_tokens=4), earlier)])
    assert len(ok.tokens) == 1 and ok.finish_reason == "length"


def test_a_seeded_draw_is_keyed_by_seed_and_output_position() -> None:
    """seeded_uniform is SplitMix64 read as a counter (seed 0 is mixed to state 0, so it
    gives SplitMix64(0)'s published outputs); a seeded row draws it at the count of its
    outputs so far, whatever generator or rows are beside it; a row whose draw raises (a
    seed that is no integer, let through by force) fails alone."""
    for k, out in enumerate([0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]):
        assert seeded_uniform(0, k) == (out >> 11) * 2.0**-53
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    hot = SamplingParams(temperature=1.3, seed=42)
    bad = SamplingParams(temperature=1.0, seed=1)
    msgspec.structs.force_setattr(bad, "seed", "x")
    outputs = [5, 6, 7]
    alone, _ = sample_rows(logits[1:2], [hot], [None], [outputs])
    mixed, failed = sample_rows(
        logits,
        [SamplingParams(temperature=0), hot, bad],
        [None, torch.Generator().manual_seed(9), None],
        [[], outputs, []],
    )
    cdf = (logits[1] / 1.3).softmax(dim=-1).double().cumsum(dim=-1)
    expected = int(torch.searchsorted(cdf, seeded_uniform(42, 3) * cdf[-1], right=True))
    assert alone == [expected] and mixed[:2] == [int(logits[0].argmax()), expected]
    assert mixed[2] is None and list(failed) == [2]
    assert "drawing its random number failed" in failed[2]
