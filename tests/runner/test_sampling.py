"""Sampling: seeds, top-k, top-p, temperature, logprobs and the stop rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.reference import assert_matches_transformers

from tokenfleet import LLM, SamplingParams
from tokenfleet.runner.sampler import CDF_BLOCK, _inverse_cdf, sample


@pytest.fixture(scope="module")
def llm(model_folder: Path) -> LLM:
    return LLM(str(model_folder), kv_cache_memory=64 << 20)


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    )


def test_seeded_request_is_the_same_alone_and_batched(llm: LLM) -> None:
    prompt = _chat(llm, "Tell me a story about a lighthouse.")
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = [_chat(llm, f"Count to {n}.") for n in range(3, 7)]
    batch = llm.generate(
        [*others[:2], prompt, *others[2:]],
        [SamplingParams(max_tokens=30, temperature=0.8)] * 2
        + [seeded]
        + [SamplingParams(max_tokens=30, temperature=0.8)] * 2,
    )
    assert batch[2].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(max_tokens=24, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_equal_greedy(llm: LLM) -> None:
    prompt = _chat(llm, "Name a famous painter.")
    greedy = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0].token_ids
    top_k = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.5, top_k=1))
    top_p = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6))
    assert top_k[0].token_ids == greedy
    assert top_p[0].token_ids == greedy


def test_sampler_truncation_keeps_exactly_the_top_k_and_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(8, 4).clone()
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    seen_k: set[int] = set()
    seen_p: set[int] = set()
    for _ in range(200):
        seen_k |= set(sample(logits, [SamplingParams(top_k=2)] * 8, gens))  # type: ignore[arg-type]
        # mass before token 1 is 0.5 < 0.7 (kept); before token 2 it is 0.8 (dropped)
        seen_p |= set(sample(logits, [SamplingParams(top_p=0.7)] * 8, gens))  # type: ignore[arg-type]
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}


@pytest.mark.parametrize("vocab", [49152, 1000, 7, CDF_BLOCK])
def test_inverse_cdf_picks_the_first_token_whose_running_sum_passes_the_draw(vocab: int) -> None:
    """The two-level search gives what one float64 search of the whole running sum gives,
    for vocabularies a whole number of blocks long and not, and never a token of zero
    probability: not at a draw of 0, nor at the largest draw below 1."""
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=gen) ** 8
    probs[:, ::3] = 0.0  # zero-probability tokens, the first one among them
    probs[1:, -1] = 0.0  # the last token too, where rounding would land a draw near 1
    probs[0, :] = 0.0
    probs[0, vocab // 2] = 1.0  # a single token with mass
    probs /= probs.sum(dim=-1, keepdim=True)
    draws = torch.rand(64, generator=gen, dtype=torch.float64)
    draws[2], draws[3] = 0.0, 1.0 - 2.0**-53
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)[:, 0]
    expected = expected.clamp(max=vocab - 1)
    got = _inverse_cdf(probs, draws)
    assert got[0] == vocab // 2
    assert bool((probs[torch.arange(64), got] > 0).all())
    same = got == expected
    # Where the two sums round differently, only a draw within rounding of a boundary may
    # differ, and it then takes a neighbour with mass.
    assert int(same.sum()) >= 62, (got[~same], expected[~same])


def test_sampling_draws_one_uniform_per_row_from_its_generator() -> None:
    """A row's token depends only on its own generator's state, whatever rows are beside
    it, greedy or not."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    hot = SamplingParams(temperature=1.3)
    greedy = SamplingParams(temperature=0)
    alone = sample(logits[1:2], [hot], [torch.Generator().manual_seed(7)])
    mixed = sample(logits, [greedy, hot, greedy], [None, torch.Generator().manual_seed(7), None])
    assert mixed[1] == alone[0]
    assert mixed[0] == int(logits[0].argmax()) and mixed[2] == int(logits[2].argmax())
    gen = torch.Generator().manual_seed(7)
    u = float(torch.rand(1, generator=gen, dtype=torch.float64))
    cdf = (logits[1] / 1.3).softmax(dim=-1).double().cumsum(dim=-1)
    assert alone[0] == int(torch.searchsorted(cdf, u * cdf[-1], right=True))


def test_sampler_follows_the_distribution_and_temperature() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 6000
    logits = probs.log().expand(n, 3).clone()
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    counts = torch.bincount(torch.tensor(sample(logits, [SamplingParams()] * n, gens)), minlength=3)  # type: ignore[arg-type]
    freq = counts.float() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert torch.all((freq - probs).abs() < 4 * sigma), freq
    # Temperature 0.5 squares the odds: 0.6^2 : 0.3^2 : 0.1^2 -> 0.783, 0.196, 0.022.
    cold = sample(logits, [SamplingParams(temperature=0.5)] * n, gens)  # type: ignore[arg-type]
    sharp = (probs**2) / (probs**2).sum()
    freq = torch.bincount(torch.tensor(cold), minlength=3).float() / n
    sigma = (sharp * (1 - sharp) / n).sqrt()
    assert torch.all((freq - sharp).abs() < 4 * sigma), freq


def test_logprobs_equal_transformers_log_softmax(llm: LLM, model_folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = _chat(llm, "Why do cats purr?")
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    assert len(out.token_ids) == 8
    assert_matches_transformers(hf, prompt, out, num_top=5)


def test_eos_stops_with_reason_stop(llm: LLM) -> None:
    out = llm.generate(
        [_chat(llm, "What is the capital of France?")], SamplingParams(max_tokens=64, temperature=0)
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == 2 and out.stop_token_id == 2
    assert 2 not in out.token_ids[:-1]
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])


def test_stop_token_ids_end_the_output_at_that_token(llm: LLM) -> None:
    prompt = _chat(llm, "Write a haiku about rust on an old bicycle.")
    greedy = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0].token_ids
    stop_at = next(i for i in range(3, 20) if greedy[i] not in greedy[:i])
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(greedy[stop_at],)),
    )[0]
    assert out.token_ids == greedy[: stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_token_id == greedy[stop_at]
    assert out.text == llm.tokenizer.decode(greedy[:stop_at])


def test_max_tokens_ends_with_reason_length(llm: LLM) -> None:
    out = llm.generate(
        [_chat(llm, "Write a long essay on bridges.")], SamplingParams(max_tokens=7, temperature=0)
    )[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.stop_token_id is None


def _penalized_reference(
    hf: torch.nn.Module, prompt: list[int], out: list[int], params: SamplingParams
) -> list[int]:
    """Greedy by hand from transformers' logits: each step's logits with the biases added
    and OpenAI's penalties for the tokens generated before it taken off."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    chosen = []
    for step in range(len(out)):
        row = logits[step].clone()
        for token_id, bias in params.logit_bias:
            row[token_id] += bias
        for token_id in set(out[:step]):
            count = out[:step].count(token_id)
            row[token_id] -= count * params.frequency_penalty + params.presence_penalty
        chosen.append(int(row.argmax()))
    return chosen


def test_presence_and_frequency_penalties_and_logit_bias_against_transformers(
    llm: LLM, model_folder: Path
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    prompt = _chat(llm, "Repeat the word 'cat' twenty times.")
    greedy = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    cases = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=2.0),
        SamplingParams(
            max_tokens=24,
            temperature=0,
            ignore_eos=True,
            presence_penalty=-0.5,
            frequency_penalty=0.7,
            logit_bias=((greedy[0].token_ids[3], -100.0), (1000, 15.0)),
        ),
    ]
    # Batched with the plain greedy request, each alone in its own row.
    outs = llm.generate(
        [prompt] * 4,
        [
            cases[0],
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            cases[1],
            cases[2],
        ],
    )
    assert outs[1].token_ids == greedy[0].token_ids
    for params, out in zip(cases, [outs[0], outs[2], outs[3]], strict=True):
        assert len(out.token_ids) == 24
        assert out.token_ids == _penalized_reference(hf, prompt, out.token_ids, params)
        assert out.token_ids != greedy[0].token_ids  # the penalties changed the text
    assert greedy[0].token_ids[3] not in outs[3].token_ids  # a -100 bias bans the token


def test_logit_bias_outside_the_vocabulary_and_bad_penalties_are_refused(llm: LLM) -> None:
    from tokenfleet.core.engine_api import EngineCoreRequest
    from tokenfleet.errors import InvalidRequestError

    params = SamplingParams(max_tokens=2, logit_bias=((49152, 1.0),))
    with pytest.raises(InvalidRequestError, match=r"token id 49152 .*\[0, 49152\)") as info:
        llm.engine.add_request(EngineCoreRequest("lb", [1, 2], params, 0.0))
    assert info.value.param == "logit_bias"
    for kwargs, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"logit_bias": ((5, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)  # type: ignore[arg-type]
        assert info.value.param == param


def test_penalties_count_only_the_generated_tokens_and_leave_logprobs_raw() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 1.0], [3.0, 2.9, 0.0, 1.0]])
    plain = SamplingParams(temperature=0, logprobs=0)
    penalized = SamplingParams(temperature=0, frequency_penalty=0.04)
    # Token 0 generated twice: 3.0 - 2 * 0.04 = 2.92, still over token 1; three times: 2.88.
    assert sample(logits, [plain, penalized], [None, None], [[], [0, 0]]) == [0, 0]
    assert sample(logits, [plain, penalized], [None, None], [[], [0, 0, 0]]) == [0, 1]
    presence = SamplingParams(temperature=0, presence_penalty=0.2)
    assert sample(logits, [presence, plain], [None, None], [[0, 0, 0, 3], []]) == [1, 0]
    assert logits[0, 0] == 3.0  # the caller's logits (and so logprobs) are untouched


def test_prompt_logprobs_equal_transformers_in_chunks_and_skip_the_prefix_cache(
    model_folder: Path,
) -> None:
    """prompt_logprobs: each prompt token's logprob (and the top k) given the tokens before
    it, as transformers computes them, over a prompt prefilled in several chunks; a second
    request with the same prompt gets them too (its prefix is not taken from the cache),
    while a plain one beside it still is."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(model_folder), kv_cache_memory=64 << 20, max_num_batched_tokens=24)
    prompt = _chat(llm, "Write three sentences about the history of the printing press.")
    assert len(prompt) > 24  # two chunks, at least
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4, logprobs=0)
    first = llm.generate([prompt], params)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt) - 1
    for position, entry in enumerate(first.prompt_logprobs, start=1):
        expected = reference[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(expected[prompt[position]].item(), abs=1e-4)
        values, ids = expected.topk(4)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    plain, again = llm.generate(
        [prompt, prompt], [SamplingParams(max_tokens=3, temperature=0), params]
    )
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    assert again.num_cached_tokens == 0 and again.prompt_logprobs is not None
    # (batched otherwise, the same sums in another order: equal to float rounding)
    assert [e.token_id for e in again.prompt_logprobs] == prompt[1:]
    assert [e.logprob for e in again.prompt_logprobs] == pytest.approx(
        [e.logprob for e in first.prompt_logprobs], abs=1e-4
    )
    assert again.token_ids == plain.token_ids == first.token_ids
