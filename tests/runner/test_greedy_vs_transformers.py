"""Greedy token ids equal Hugging Face transformers' on the same folder, token for token,
however the engine batches, chunks, shares prefixes or preempts, with its overlap (the
default: the next step planned while one runs) and without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenfleet import LLM, SamplingParams
from tokenfleet.checkpoint.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
BLOCK_SIZE = 16
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rust on an old bicycle.",
    "List three prime numbers greater than 50.",
    "Explain in one sentence why the sky is blue.",
    "Translate 'good morning, my friend' into Spanish.",
    "def fib(n):\n    # complete this Python function",
    "What is 17 * 23? Show your working.",
    "Give me a name for a pet turtle that loves jazz.",
]
SYSTEM = (
    "You are a careful assistant for a small library in a mountain town. You answer "
    "questions from visitors of every age, briefly and politely, in plain English. When "
    "you are not sure of a fact, you say so instead of guessing. You never invent book "
    "titles, authors or opening hours. You prefer short paragraphs and lists of at most "
    "three items, and you keep every answer under one hundred words. If a visitor asks about "
    "something the library does not hold, you suggest asking the librarian at the desk."
)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)


def _prompts(folder: Path, system: str | None) -> list[list[int]]:
    tok = Tokenizer(folder)
    out = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        out.append(tok.encode(tok.apply_chat_template(messages)))
    return out


@pytest.fixture(scope="module")
def prompts(model_folder: Path) -> list[list[int]]:
    return _prompts(model_folder, None)


@pytest.fixture(scope="module")
def shared_prompts(model_folder: Path) -> list[list[int]]:
    return _prompts(model_folder, SYSTEM)


@pytest.fixture(scope="module")
def hf_model(model_folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module")
def expected(hf_model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return _hf_greedy(hf_model, prompts)


@pytest.fixture(scope="module")
def expected_shared(hf_model: torch.nn.Module, shared_prompts: list[list[int]]) -> list[list[int]]:
    return _hf_greedy(hf_model, shared_prompts)


def _ids(outputs: list) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_reference_outputs_are_varied(expected: list[list[int]]) -> None:
    # Guards the comparison itself: distinct continuations, some stopping at EOS early.
    assert len({tuple(e) for e in expected}) == len(QUESTIONS)
    assert all(1 <= len(e) <= NEW_TOKENS for e in expected)


def test_one_request_at_a_time_matches_transformers(
    model_folder: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    llm = LLM(str(model_folder), kv_cache_memory=64 << 20)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected


def test_float16_kv_cache_holds_twice_the_tokens_and_matches_transformers(
    model_folder: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """K/V rounded to float16 when written (--kv-cache-dtype float16): the same memory
    holds twice the blocks, and on these prompts greedy decoding still picks every token
    transformers picks in float32 (bfloat16's 8-bit mantissa does not: one of the eight
    turns at its 19th token, so it is not claimed here)."""
    memory = 64 << 20
    full = LLM(str(model_folder), kv_cache_memory=memory).engine.runner
    llm = LLM(str(model_folder), kv_cache_memory=memory, kv_cache_dtype="float16")
    runner = llm.engine.runner
    assert runner.kv_caches[0].dtype == torch.float16
    assert runner.num_blocks == 2 * full.num_blocks
    assert runner.kv_cache_bytes == full.kv_cache_bytes
    assert _ids(llm.generate(prompts, GREEDY)) == expected


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_batched_chunked_prefill_matches_transformers(
    model_folder: Path, prompts: list[list[int]], expected: list[list[int]], overlap: bool
) -> None:
    budget = 24
    assert max(len(p) for p in prompts) > budget  # every prompt needs several chunks
    llm = LLM(
        str(model_folder),
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=budget,
        kv_cache_memory=64 << 20,
        enable_prefix_caching=False,
        overlap=overlap,
    )
    assert _ids(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions == 0
    assert (llm.engine.num_steps_planned_ahead > 0) == overlap


def test_shared_system_prompt_hits_prefix_cache_and_matches_transformers(
    model_folder: Path, shared_prompts: list[list[int]], expected_shared: list[list[int]]
) -> None:
    common = 0
    while len({p[common] for p in shared_prompts}) == 1:
        common += 1
    assert common >= 100
    llm = LLM(str(model_folder), block_size=BLOCK_SIZE, kv_cache_memory=64 << 20)
    outputs = llm.generate(shared_prompts, GREEDY)
    assert _ids(outputs) == expected_shared
    # Request 0 caches the shared blocks; each of the 7 others hits every full one.
    hit = (common // BLOCK_SIZE) * BLOCK_SIZE
    assert [o.num_cached_tokens for o in outputs] == [0] + [hit] * 7
    kv = llm.engine.kv
    assert kv.num_prefix_hits == 7 * hit
    assert kv.num_prefix_queries == sum(len(p) for p in shared_prompts)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_preemption_under_small_kv_budget_matches_transformers(
    model_folder: Path, prompts: list[list[int]], expected: list[list[int]], overlap: bool
) -> None:
    bytes_per_block = 2 * 30 * 3 * 64 * 4 * BLOCK_SIZE
    num_blocks = 14  # room for about two requests of the eight at once
    llm = LLM(
        str(model_folder),
        block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * bytes_per_block,
        overlap=overlap,
    )
    assert llm.engine.kv.pool.num_blocks == num_blocks
    assert _ids(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.pool.num_free_blocks == num_blocks
