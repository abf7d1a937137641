"""Bad input to the engine: each a clear, typed error naming the value and the limit,
and nothing already accepted is disturbed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenfleet import LLM, SamplingParams
from tokenfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.errors import ContextLengthError, InvalidRequestError


@pytest.fixture(scope="module")
def llm(model_folder: Path) -> LLM:
    return LLM(str(model_folder), max_model_len=256, kv_cache_memory=32 << 20)


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
        ({"max_tokens": -5}, "max_tokens", "max_tokens must be at least 1, got -5"),
        ({"top_p": 0.0}, "top_p", r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "top_p", r"top_p must be in \(0, 1\], got 1.5"),
        ({"temperature": -0.1}, "temperature", "temperature must be >= 0, got -0.1"),
        ({"top_k": -2}, "top_k", "top_k must be -1, 0 .off. or positive, got -2"),
        ({"logprobs": 21}, "logprobs", "logprobs must be between 0 and 20, got 21"),
    ],
)
def test_bad_sampling_params_name_value_and_limit(
    kwargs: dict[str, float], param: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_empty_prompt_is_rejected(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="prompt must contain at least one token"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="prompt must contain at least one token"):
        llm.generate([""], SamplingParams(max_tokens=4))


def test_prompt_plus_max_tokens_beyond_context_names_both_numbers(llm: LLM) -> None:
    prompt = [100] * 200
    with pytest.raises(ContextLengthError) as info:
        llm.generate([prompt], SamplingParams(max_tokens=57))
    assert str(info.value) == (
        "prompt (200 tokens) plus max_tokens (57) is 257 tokens, over the context length of 256"
    )
    assert info.value.param == "max_tokens"
    # At the limit exactly, it is accepted and runs to length.
    out = llm.generate([prompt], SamplingParams(max_tokens=56, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 56 and out.finish_reason == "length"


def test_token_id_outside_vocabulary_is_rejected(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match=r"token id 49152 is outside the vocabulary"):
        llm.generate([[1, 2, 49152]], SamplingParams(max_tokens=2))


def test_a_rejected_request_does_not_disturb_accepted_ones(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request(EngineCoreRequest("ok", [5, 6, 7], params, 0.0))
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineCoreRequest("bad", [], params, 0.0))
    with pytest.raises(InvalidRequestError, match="request id 'ok' is in use"):
        engine.add_request(EngineCoreRequest("ok", [5], params, 0.0))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            assert out.req_id == "ok"
            tokens += out.new_token_ids
    assert len(tokens) == 5
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_context_length_is_capped_by_the_kv_cache(model_folder: Path) -> None:
    bytes_per_block = 2 * 30 * 3 * 64 * 4 * 16
    llm = LLM(str(model_folder), kv_cache_memory=10 * bytes_per_block)
    assert llm.engine.max_model_len == 160
    with pytest.raises(ContextLengthError, match="over the context length of 160"):
        llm.generate([[5] * 150], SamplingParams(max_tokens=11))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CacheConfig(block_size=12), "block_size must be a power of two, got 12"),
        (lambda: CacheConfig(kv_cache_memory=0), "kv_cache_memory must be positive, got 0"),
        (
            lambda: CacheConfig(kv_cache_memory_fraction=1.5),
            r"kv_cache_memory_fraction must be in \(0, 1\], got 1.5",
        ),
        (
            lambda: CacheConfig(kv_cache_dtype="int8"),
            "kv_cache_dtype must be one of auto, float16, bfloat16, got 'int8'",
        ),
        (
            lambda: SchedulerConfig(max_num_seqs=0),
            "max_num_seqs must be at least 1, got 0",
        ),
        (lambda: EngineConfig(dtype="int8"), "dtype must be one of"),
        (lambda: EngineConfig(num_threads=0), "num_threads must be at least 1, got 0"),
    ],
)
def test_bad_engine_settings_are_refused_at_construction(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_kv_budget_too_small_for_one_block(model_folder: Path) -> None:
    with pytest.raises(ValueError, match=r"a KV budget of 1000 bytes holds no block"):
        LLM(str(model_folder), kv_cache_memory=1000)
