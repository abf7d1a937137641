"""The OpenAI-compatible API over a real `tokenfleet serve` process, through the official
`openai` client (sync and async) and raw httpx bytes: greedy text, usage and logprobs equal
the in-process engine's, streaming and SSE framing, n > 1 with seeds, legacy completions,
errors in OpenAI's format with exact statuses, metrics, and a disconnect freeing blocks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.live_server import (
    GENERATED_TOKENS,
    HTTP_TIMEOUT_S,
    MODEL,
    LiveServer,
    admission_retry_after,
    live_server,
)

from tokenfleet import LLM, SamplingParams
from tokenfleet.llm import RequestOutput

pytestmark = pytest.mark.slow

# Greedy answers to EOS_CHAT end with the EOS token well within 40 tokens; LONG_CHAT runs on.
EOS_CHAT = [{"role": "user", "content": "What is 2+2?"}]
LONG_CHAT = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
PROMPT = "The capital of France is"
PROMPT_2 = "Once upon a time, there was"
CHAT_ROUTE = "/v1/chat/completions"
CMPL_ROUTE = "/v1/completions"
ERROR_KEYS = {"message", "type", "param", "code"}


# -- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("openai"), model_folder=model_folder) as s:
        yield s


@pytest.fixture(scope="module")
def spare_server(
    model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """A server of its own for a fresh prefix cache and for killing its engine. Its tests
    are not about admission: a generous TTFT target, so that a start-up profile timed on a
    busy machine (prefill priced 3x slow in one CI run) cannot refuse their prompts."""
    folder = tmp_path_factory.mktemp("openai-spare")
    with live_server(folder, "--ttft-target", "60", model_folder=model_folder) as s:
        yield s


class Reference:
    """The in-process engine's greedy outputs, each computed once per module."""

    def __init__(self, folder: Path) -> None:
        # One thread, as the server's engine: quick on a busy machine, and the same arithmetic.
        self.llm = LLM(str(folder), kv_cache_memory=64 << 20, num_threads=1)
        self._cache: dict[str, RequestOutput] = {}

    def chat(
        self, messages: list[dict[str, str]], max_tokens: int, logprobs: int | None = None
    ) -> RequestOutput:
        key = json.dumps(["chat", messages, max_tokens, logprobs])
        if key not in self._cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs)
            self._cache[key] = self.llm.chat([messages], params)[0]
        return self._cache[key]

    def generate(self, prompt: str, max_tokens: int, logprobs: int | None = None) -> RequestOutput:
        key = json.dumps(["generate", prompt, max_tokens, logprobs])
        if key not in self._cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs)
            self._cache[key] = self.llm.generate([prompt], params)[0]
        return self._cache[key]


@pytest.fixture(scope="module")
def ref(model_folder: Path) -> Reference:
    return Reference(model_folder)


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _async_client(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _metrics_text(server: LiveServer) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=5).text


def _wait_for_gauges(server: LiveServer) -> None:
    """The engine gauges appear with the engine's first step message (a heartbeat when idle)."""
    _wait_for(lambda: "tokenfleet_kv_blocks_total " in _metrics_text(server), 60, "engine gauges")


def _samples(server: LiveServer) -> list[tuple[str, dict[str, str], float]]:
    text = _metrics_text(server)
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _labelled(server: LiveServer, name: str, labels: dict[str, str]) -> float:
    values = [v for n, lab, v in _samples(server) if n == name and lab == labels]
    assert len(values) == 1, f"{name}{labels} not in /metrics exactly once"
    return values[0]


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def _chat_body(messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, **fields}


def _assert_answers(server: LiveServer) -> None:
    """The server still answers an ordinary request."""
    r = _client(server).chat.completions.create(
        model=MODEL, messages=EOS_CHAT, max_tokens=2, temperature=0
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 2


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of a response, after checking its status and shape."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    return dict(body["error"])


def _tokens_to_stop(ref: RequestOutput, llm: LLM, stop: str) -> int:
    """How many output tokens it takes for the text to contain `stop`."""
    for k in range(1, len(ref.token_ids) + 1):
        if stop in llm.tokenizer.decode(ref.token_ids[:k]):
            return k
    raise AssertionError(f"{stop!r} not in the reference output")


def _assert_usage(usage: Any, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
    )


# -- 1. chat completions: greedy text, usage, finish reasons, stop strings -------------------


def test_chat_greedy_eos_matches_reference(server: LiveServer, ref: Reference) -> None:
    expected = ref.chat(EOS_CHAT, 40)
    assert expected.finish_reason == "stop" and expected.stop_token_id is not None
    assert expected.token_ids[-1] == expected.stop_token_id  # counted as a completion token
    r = _client(server).chat.completions.create(
        model=MODEL, messages=EOS_CHAT, max_tokens=40, temperature=0
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == "stop" and choice.logprobs is None
    _assert_usage(r.usage, len(expected.prompt_token_ids), len(expected.token_ids))


@pytest.mark.parametrize("limit", ["max_tokens", "max_completion_tokens"])
def test_chat_greedy_length(server: LiveServer, ref: Reference, limit: str) -> None:
    expected = ref.chat(LONG_CHAT, 12)
    assert expected.finish_reason == "length" and len(expected.token_ids) == 12
    r = _client(server).chat.completions.create(
        model=MODEL, messages=LONG_CHAT, temperature=0, **{limit: 12}
    )
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == "length"
    _assert_usage(r.usage, len(expected.prompt_token_ids), 12)


def test_chat_stop_string_cuts_the_text(server: LiveServer, ref: Reference) -> None:
    expected = ref.chat(LONG_CHAT, 24)
    text = expected.text
    words = text.split(" ")
    stop = " " + words[len(words) // 2]  # a word in the middle, with its leading space
    assert stop in text and text.index(stop) > 0
    r = _client(server).chat.completions.create(
        model=MODEL, messages=LONG_CHAT, temperature=0, max_tokens=24, stop=["@@never@@", stop]
    )
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None
    assert r.usage.completion_tokens == _tokens_to_stop(expected, ref.llm, stop)

    # Streamed, the same cut, never a character of the stop string.
    stream = _client(server).chat.completions.create(
        model=MODEL, messages=LONG_CHAT, temperature=0, max_tokens=24, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[: text.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


# -- 2. streaming ------------------------------------------------------------------------------


def test_chat_stream_with_usage(server: LiveServer, ref: Reference) -> None:
    expected = ref.chat(EOS_CHAT, 40)
    stream = _client(server).chat.completions.create(
        model=MODEL,
        messages=EOS_CHAT,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    first, last = chunks[0], chunks[-1]
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    # The last chunk has no choices and the usage; every other one has usage null.
    assert last.choices == []
    _assert_usage(last.usage, len(expected.prompt_token_ids), len(expected.token_ids))
    body = chunks[:-1]
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == expected.text
    reasons = [c.choices[0].finish_reason for c in body]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}


def test_chat_stream_length_without_usage(server: LiveServer, ref: Reference) -> None:
    expected = ref.chat(LONG_CHAT, 12)
    chunks = list(
        _client(server).chat.completions.create(
            model=MODEL, messages=LONG_CHAT, max_completion_tokens=12, temperature=0, stream=True
        )
    )
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_async_streamed_and_not(server: LiveServer, ref: Reference) -> None:
    eos, long = ref.chat(EOS_CHAT, 40), ref.chat(LONG_CHAT, 12)

    async def main() -> None:
        async with _async_client(server) as client:

            async def whole() -> Any:
                return await client.chat.completions.create(
                    model=MODEL, messages=EOS_CHAT, max_tokens=40, temperature=0
                )

            async def streamed() -> tuple[str, list[Any]]:
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=LONG_CHAT,
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                return text, chunks

            # Both at once: batched in the engine, still the greedy reference.
            r, (text, chunks) = await asyncio.gather(whole(), streamed())
            assert r.choices[0].message.content == eos.text
            assert r.choices[0].finish_reason == "stop"
            assert r.usage.completion_tokens == len(eos.token_ids)
            assert r.usage.prompt_tokens == len(eos.prompt_token_ids)
            assert text == long.text
            assert chunks[0].choices[0].delta.role == "assistant"
            assert chunks[-2].choices[0].finish_reason == "length"
            assert chunks[-1].usage.completion_tokens == 12
            assert chunks[-1].usage.prompt_tokens == len(long.prompt_token_ids)

    asyncio.run(main())


# -- 3. n > 1 ---------------------------------------------------------------------------------


def test_n_greedy_choices_all_equal_the_reference(server: LiveServer, ref: Reference) -> None:
    expected = ref.chat(EOS_CHAT, 40)
    r = _client(server).chat.completions.create(
        model=MODEL, messages=EOS_CHAT, max_tokens=40, temperature=0, n=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [expected.text] * 3
    assert [c.finish_reason for c in r.choices] == ["stop"] * 3
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)  # the prompt, once
    assert r.usage.completion_tokens == 3 * len(expected.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_n_sampled_choices_follow_seed_plus_index(server: LiveServer) -> None:
    client = _client(server)

    def sample(seed: int, n: int) -> list[str]:
        r = client.chat.completions.create(
            model=MODEL, messages=LONG_CHAT, max_tokens=10, temperature=1, seed=seed, n=n
        )
        assert [c.index for c in r.choices] == list(range(n))
        assert r.usage is not None and r.usage.completion_tokens <= 10 * n
        return [c.message.content or "" for c in r.choices]

    first = sample(1234, 3)
    assert sample(1234, 3) == first  # the same request, the same choices
    assert len(set(first)) == 3  # choices differ from each other
    other = sample(98765, 3)
    assert all(a != b for a, b in zip(first, other, strict=True))
    # Choice i is sampled with seed + i.
    assert sample(1235, 1) == [first[1]]
    assert sample(1236, 2)[0] == first[2]

    # Streamed: each index's deltas make the non-streamed choice.
    texts = ["", "", ""]
    reasons: list[str | None] = [None, None, None]
    roles = set()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=LONG_CHAT,
        max_tokens=10,
        temperature=1,
        seed=1234,
        n=3,
        stream=True,
    )
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
            if c.finish_reason:
                assert reasons[c.index] is None
                reasons[c.index] = c.finish_reason
    assert texts == first
    assert roles == {0, 1, 2}
    assert all(r in ("stop", "length") for r in reasons)


def test_n_shares_prompt_blocks(spare_server: LiveServer) -> None:
    """On a server that has seen no prompt yet, the n choices of one long prompt share its
    blocks: the prefix cache hit rate goes from 0 to above 0."""
    _wait_for_gauges(spare_server)
    assert spare_server.metric("tokenfleet_prefix_cache_hit_rate") == 0
    long_text = " ".join(f"Item {i} is a {'red' if i % 2 else 'blue'} box." for i in range(60))
    r = _client(spare_server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": long_text}],
        max_tokens=2,
        temperature=0,
        n=4,
    )
    assert r.usage is not None and r.usage.prompt_tokens > 300
    assert len(r.choices) == 4
    rate = spare_server.metric("tokenfleet_prefix_cache_hit_rate")
    assert 0 < rate < 1


# -- 4. logprobs ------------------------------------------------------------------------------


def test_chat_logprobs_match_the_engine(server: LiveServer, ref: Reference) -> None:
    expected = ref.chat(LONG_CHAT, 8, logprobs=3)
    assert expected.logprobs is not None and len(expected.logprobs) == 8
    tokenizer = ref.llm.tokenizer
    r = _client(server).chat.completions.create(
        model=MODEL, messages=LONG_CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    assert choice.message.content == expected.text
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 8
    for got, want in zip(content, expected.logprobs, strict=True):
        text = tokenizer.decode([want.token_id], skip_special_tokens=False)
        assert got.token == text and got.bytes == list(text.encode())
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert len(got.top_logprobs) == 3
        assert [t.token for t in got.top_logprobs] == [
            tokenizer.decode([t], skip_special_tokens=False) for t, _ in want.top
        ]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [lp for _, lp in want.top], abs=1e-4
        )
        # Greedy: the chosen token is the most likely one.
        assert got.top_logprobs[0].token == got.token
        assert got.top_logprobs[0].logprob == pytest.approx(got.logprob, abs=1e-6)
    assert "".join(t.token for t in content) == expected.text

    # Streamed, the same logprobs, token by token; also while a stop string that never
    # completes holds a token's text back.
    hold = content[2].token + "@@"
    assert hold not in expected.text
    for stop in (None, [hold]):
        stream = _client(server).chat.completions.create(
            model=MODEL,
            messages=LONG_CHAT,
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            stop=stop,
        )
        chunks = [c for c in stream if c.choices]
        streamed = [
            t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content or []
        ]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        assert [t.token for t in streamed] == [t.token for t in content]
        # The same prompt again hits the prefix cache: its tail runs as a short chunk in
        # the C kernel, which sums in another order than the first request's whole-prompt
        # path (float32 differences of ~1e-6), so the tolerance of the engine comparisons.
        assert [t.logprob for t in streamed] == pytest.approx(
            [t.logprob for t in content], abs=1e-4
        )
        assert all(len(t.top_logprobs) == 3 for t in streamed)


# -- 5. completions ---------------------------------------------------------------------------


def test_completions_prompt_text_and_token_ids(server: LiveServer, ref: Reference) -> None:
    expected = ref.generate(PROMPT, 12)
    client = _client(server)
    for prompt in (PROMPT, expected.prompt_token_ids):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
        assert len(r.choices) == 1
        assert r.choices[0].index == 0 and r.choices[0].text == expected.text
        assert r.choices[0].finish_reason == expected.finish_reason == "length"
        assert r.choices[0].logprobs is None
        _assert_usage(r.usage, len(expected.prompt_token_ids), 12)


def test_completions_stream(server: LiveServer, ref: Reference) -> None:
    expected = ref.generate(PROMPT, 12)
    chunks = list(
        _client(server).completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    last, body = chunks[-1], chunks[:-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert all(len(c.choices) == 1 and c.choices[0].index == 0 for c in body)
    assert "".join(c.choices[0].text for c in body) == expected.text
    reasons = [c.choices[0].finish_reason for c in body]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}


def test_completions_logprobs(server: LiveServer, ref: Reference) -> None:
    expected = ref.generate(PROMPT, 10, logprobs=2)
    assert expected.logprobs is not None
    tokenizer = ref.llm.tokenizer
    r = _client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2
    )
    choice = r.choices[0]
    assert choice.text == expected.text
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    want_tokens = [
        tokenizer.decode([e.token_id], skip_special_tokens=False) for e in expected.logprobs
    ]
    assert lp.tokens == want_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert len(lp.top_logprobs) == 10
    for top, e in zip(lp.top_logprobs, expected.logprobs, strict=True):
        want = {tokenizer.decode([t], skip_special_tokens=False): v for t, v in e.top}
        assert len(top) == 2 and set(top) == set(want)
        assert [top[k] for k in want] == pytest.approx(list(want.values()), abs=1e-4)
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets

    # Streamed, the same tokens and offsets, a chunk at a time; also while a stop string
    # that never completes holds a token's text back (that chunk has logprobs, no text).
    hold = lp.tokens[3] + "@@"
    assert hold not in expected.text
    for stop in (None, [hold]):
        chunks = list(
            _client(server).completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=10,
                temperature=0,
                logprobs=2,
                stream=True,
                stop=stop,
            )
        )
        tokens, token_logprobs, text_offset = [], [], []
        for c in chunks:
            part = c.choices[0].logprobs
            assert part is not None
            tokens += part.tokens or []
            token_logprobs += part.token_logprobs or []
            text_offset += part.text_offset or []
        assert "".join(c.choices[0].text for c in chunks) == expected.text
        assert tokens == lp.tokens and text_offset == lp.text_offset
        assert token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)  # as above
        if stop:
            assert any(c.choices[0].text == "" and c.choices[0].logprobs.tokens for c in chunks)


def test_completions_echo_with_the_prompts_logprobs(server: LiveServer, ref: Reference) -> None:
    """echo: the prompt before the completion; with logprobs, the prompt's tokens too (the
    first with none), each as the engine scores it (prompt_logprobs, checked against
    transformers in tests/test_sampling.py), as an evaluation harness asks for them."""
    tokenizer = ref.llm.tokenizer
    prompt_ids = tokenizer.encode(PROMPT_2)
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2)
    expected = ref.llm.generate([prompt_ids], params)[0]
    assert expected.prompt_logprobs is not None and expected.logprobs is not None
    client = _client(server)

    plain = client.completions.create(
        model=MODEL, prompt=PROMPT_2, max_tokens=3, temperature=0, echo=True, n=2
    )
    assert [c.text for c in plain.choices] == [PROMPT_2 + expected.text] * 2
    assert plain.choices[0].logprobs is None
    _assert_usage(plain.usage, len(prompt_ids), 6)

    r = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = r.choices[0]
    echoed = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert choice.text == echoed + expected.text
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    scored = [*expected.prompt_logprobs, *expected.logprobs]
    all_ids = prompt_ids + expected.token_ids
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in all_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in scored], abs=1e-4)
    for top, e in zip(lp.top_logprobs[1:], scored, strict=True):
        want = {tokenizer.decode([t], skip_special_tokens=False): v for t, v in e.top}
        assert top is not None and set(top) == set(want)
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets

    # Streamed: the first chunk carries the echo, the whole equals the reply above.
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt_ids,
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=2,
            stream=True,
        )
    )
    assert chunks[0].choices[0].text.startswith(echoed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert streamed == lp.tokens

    # max_tokens 0: the prompt scored, nothing generated (only with echo).
    scored_only = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=2
    )
    only = scored_only.choices[0]
    assert only.text == echoed and only.finish_reason == "length"
    assert only.logprobs is not None and only.logprobs.tokens == lp.tokens[: len(prompt_ids)]
    assert only.logprobs.token_logprobs is not None and only.logprobs.token_logprobs[0] is None
    assert only.logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1 : len(prompt_ids)], abs=1e-4
    )
    _assert_usage(scored_only.usage, len(prompt_ids), 0)
    body = {"model": MODEL, "prompt": PROMPT_2, "max_tokens": 0}
    error = _error(httpx.post(server.url + CMPL_ROUTE, json=body, timeout=HTTP_TIMEOUT_S), 400)
    assert error["param"] == "max_tokens" and "echo" in error["message"]


def test_completions_two_prompts_in_order(server: LiveServer, ref: Reference) -> None:
    first, second = ref.generate(PROMPT, 8), ref.generate(PROMPT_2, 8)
    r = _client(server).completions.create(
        model=MODEL, prompt=[PROMPT, PROMPT_2], max_tokens=8, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [first.text, second.text]
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(first.prompt_token_ids) + len(second.prompt_token_ids)
    assert r.usage.completion_tokens == 16

    # As token id lists, with n=2: prompt-major, choice index = prompt * n + j.
    r = _client(server).completions.create(
        model=MODEL,
        prompt=[first.prompt_token_ids, second.prompt_token_ids],
        max_tokens=8,
        temperature=0,
        n=2,
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [first.text] * 2 + [second.text] * 2
    assert r.usage is not None and r.usage.completion_tokens == 32
    assert r.usage.prompt_tokens == len(first.prompt_token_ids) + len(second.prompt_token_ids)


# -- 6. SSE framing, byte for byte ------------------------------------------------------------


def _sse_frames(server: LiveServer, path: str, body: dict[str, Any]) -> list[bytes]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b"data: [DONE]\n\n")
    assert raw.count(b"[DONE]") == 1
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    frames = frames[:-1]
    for frame in frames:
        assert frame.startswith(b"data: "), frame
        assert b"\n" not in frame and b"\r" not in frame, frame  # one line; no `event:`
    assert frames[-1] == b"data: [DONE]"
    return [frame[len(b"data: ") :] for frame in frames[:-1]]


def test_sse_framing_chat(server: LiveServer, ref: Reference) -> None:
    expected = ref.chat(EOS_CHAT, 40)
    body = _chat_body(
        EOS_CHAT,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = [json.loads(f) for f in _sse_frames(server, CHAT_ROUTE, body)]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == expected.text
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == len(expected.token_ids)


def test_streams_start_before_the_first_token(server: LiveServer, ref: Reference) -> None:
    """With the engine process stopped (SIGSTOP), a chat stream still gets its 200 and the
    role chunk, and a completions stream its 200 (its first chunk carries text); the
    tokens follow once the engine runs on (SIGCONT)."""
    expected = ref.chat(EOS_CHAT, 40)
    chat = _chat_body(EOS_CHAT, max_tokens=40, temperature=0, stream=True)
    cmpl = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    engine_pid = server.engine_pid()
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        with (
            httpx.stream("POST", server.url + CHAT_ROUTE, json=chat, timeout=20) as first,
            httpx.stream("POST", server.url + CMPL_ROUTE, json=cmpl, timeout=20) as second,
        ):
            assert (first.status_code, second.status_code) == (200, 200)
            chunks = first.iter_raw()
            raw = b""
            while b"\n\n" not in raw:
                raw += next(chunks)
            head = json.loads(raw.split(b"\n\n")[0].removeprefix(b"data: "))
            assert head["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            os.kill(engine_pid, signal.SIGCONT)
            raw += b"".join(chunks)
            second.read()
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    frames = [f.removeprefix(b"data: ") for f in raw.strip().split(b"\n\n")]
    assert frames[-1] == b"[DONE]"
    events = [json.loads(f) for f in frames[:-1]]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == expected.text
    assert second.text.endswith("data: [DONE]\n\n")


def test_sse_framing_completions(server: LiveServer, ref: Reference) -> None:
    expected = ref.generate(PROMPT, 12)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    events = [json.loads(f) for f in _sse_frames(server, CMPL_ROUTE, body)]
    assert {e["object"] for e in events} == {"text_completion"}
    assert "".join(e["choices"][0]["text"] for e in events) == expected.text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# -- 7. models --------------------------------------------------------------------------------


def test_models_list(server: LiveServer) -> None:
    models = list(_client(server).models.list())
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model" and models[0].owned_by == "tokenfleet"
    assert models[0].created > 0
    assert _client(server).models.retrieve(MODEL) == models[0]
    with pytest.raises(openai.NotFoundError) as info:
        _client(server).models.retrieve("gpt-4o")
    assert info.value.body == {
        "message": f"model 'gpt-4o' not found; this server serves '{MODEL}'",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


# -- 8. errors --------------------------------------------------------------------------------


def test_malformed_json(server: LiveServer) -> None:
    r = httpx.post(
        server.url + CHAT_ROUTE,
        content=b'{"model": "smollm2-135m-instruct", "messages": [',
        headers={"content-type": "application/json"},
        timeout=HTTP_TIMEOUT_S,
    )
    error = _error(r, 400)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("malformed JSON body")
    _assert_answers(server)


def test_missing_messages(server: LiveServer) -> None:
    error = _error(
        httpx.post(server.url + CHAT_ROUTE, json={"model": MODEL}, timeout=HTTP_TIMEOUT_S), 400
    )
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert "messages" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).chat.completions.create(model=MODEL, messages=[])
    assert info.value.status_code == 400
    assert info.value.param == "messages"
    _assert_answers(server)


def test_wrong_type(server: LiveServer) -> None:
    r = httpx.post(
        server.url + CHAT_ROUTE, json=_chat_body(EOS_CHAT, max_tokens="x"), timeout=HTTP_TIMEOUT_S
    )
    error = _error(r, 400)
    assert error["param"] == "max_tokens" and "max_tokens" in error["message"]
    assert error["type"] == "invalid_request_error"
    r = httpx.post(
        server.url + CMPL_ROUTE,
        json={"model": MODEL, "prompt": PROMPT, "n": "many"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert _error(r, 400)["param"] == "n"
    _assert_answers(server)


def test_stream_options_without_stream_is_refused(server: LiveServer) -> None:
    """As OpenAI does: stream_options on a reply that is not streamed is a 400 naming it,
    on both routes, through the official client too; with stream it is served."""
    message = "The 'stream_options' parameter is only allowed when 'stream' is enabled."
    options = {"include_usage": True}
    for route, body in [
        (CHAT_ROUTE, _chat_body(EOS_CHAT, max_tokens=2, stream_options=options)),
        (
            CMPL_ROUTE,
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream_options": options},
        ),
        (CHAT_ROUTE, _chat_body(EOS_CHAT, max_tokens=2, stream=False, stream_options=options)),
    ]:
        error = _error(httpx.post(server.url + route, json=body, timeout=HTTP_TIMEOUT_S), 400)
        assert error == {
            "message": message,
            "type": "invalid_request_error",
            "param": "stream_options",
            "code": None,
        }
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).chat.completions.create(
            model=MODEL, messages=EOS_CHAT, max_tokens=2, stream_options=options
        )
    assert info.value.param == "stream_options"
    _assert_answers(server)


def test_unknown_model(server: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _client(server).chat.completions.create(model="gpt-4o", messages=EOS_CHAT)
    assert info.value.status_code == 404
    body = info.value.body
    assert isinstance(body, dict) and set(body) == ERROR_KEYS  # the client unwraps "error"
    assert body["param"] == "model" and body["code"] == "model_not_found"
    assert "gpt-4o" in body["message"]
    with pytest.raises(openai.NotFoundError):
        _client(server).completions.create(model="gpt-4o", prompt=PROMPT)
    _assert_answers(server)


def test_context_length_exceeded(server: LiveServer, ref: Reference) -> None:
    num_prompt = len(ref.chat(EOS_CHAT, 40).prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).chat.completions.create(model=MODEL, messages=EOS_CHAT, max_tokens=100000)
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "max_tokens"
    assert f"{num_prompt} tokens" in body["message"] and "100000" in body["message"]
    # Completions, with a token-id prompt.
    r = httpx.post(
        server.url + CMPL_ROUTE,
        json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 123456},
        timeout=HTTP_TIMEOUT_S,
    )
    error = _error(r, 400)
    assert "3 tokens" in error["message"] and "123456" in error["message"]
    _assert_answers(server)


def test_penalties_and_logit_bias_equal_the_engine(server: LiveServer, ref: Reference) -> None:
    """presence_penalty, frequency_penalty and logit_bias reach the engine: the text equals
    the in-process engine's with the same SamplingParams (tests/test_sampling.py checks
    those against transformers' logits), chat and streamed completions alike."""
    greedy = ref.chat(LONG_CHAT, 20)
    banned = greedy.token_ids[2]
    params = SamplingParams(
        max_tokens=20,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=1.2,
        logit_bias=((banned, -100.0),),
    )
    expected = ref.llm.chat([LONG_CHAT], params)[0]
    assert expected.token_ids != greedy.token_ids and banned not in expected.token_ids
    r = _client(server).chat.completions.create(
        model=MODEL,
        messages=LONG_CHAT,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=1.2,
        logit_bias={str(banned): -100},
    )
    assert r.choices[0].message.content == expected.text
    _assert_usage(r.usage, len(expected.prompt_token_ids), 20)

    params = SamplingParams(max_tokens=24, temperature=0, frequency_penalty=2.0)
    expected = ref.llm.generate([PROMPT_2], params)[0]
    stream = _client(server).completions.create(
        model=MODEL,
        prompt=PROMPT_2,
        max_tokens=24,
        temperature=0,
        frequency_penalty=2.0,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in stream) == expected.text
    assert expected.token_ids != ref.generate(PROMPT_2, 24).token_ids


def test_stop_token_ids_end_the_choice_at_that_token(server: LiveServer, ref: Reference) -> None:
    """vLLM's stop_token_ids, served as the engine serves it: the choice ends at the first
    of them with finish_reason stop, its text without that token's, counted in usage."""
    greedy = ref.chat(LONG_CHAT, 20)
    k = next(i for i in range(3, 20) if greedy.token_ids[i] not in greedy.token_ids[:i])
    r = _client(server).chat.completions.create(
        model=MODEL,
        messages=LONG_CHAT,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
        extra_body={"stop_token_ids": [greedy.token_ids[k], 49151]},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ref.llm.tokenizer.decode(greedy.token_ids[:k])
    _assert_usage(r.usage, len(greedy.prompt_token_ids), k + 1)
    body = _chat_body(EOS_CHAT, stop_token_ids=[49152])
    error = _error(httpx.post(server.url + CHAT_ROUTE, json=body, timeout=HTTP_TIMEOUT_S), 400)
    assert error["param"] == "stop_token_ids" and "49152" in error["message"]


def test_unsupported_parameters_are_400s_naming_them(server: LiveServer) -> None:
    """A parameter this server does not serve, asked for, is a 400 naming it (not a reply
    that ignored it); the same parameter at its default value is no error."""
    refused_chat = [
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"logit_bias": {"cat": 1}}, "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias.5"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ]
    for fields, param in refused_chat:
        error = _error(
            httpx.post(
                server.url + CHAT_ROUTE, json=_chat_body(EOS_CHAT, **fields), timeout=HTTP_TIMEOUT_S
            ),
            400,
        )
        assert error["param"] == param, fields
        assert error["message"].startswith(f"{param}: "), error
        assert error["type"] == "invalid_request_error"
    function_turn = [
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "user", "content": "and then?"},
    ]
    error = _error(
        httpx.post(server.url + CHAT_ROUTE, json=_chat_body(function_turn), timeout=HTTP_TIMEOUT_S),
        400,
    )
    assert error["param"] == "messages.0.function_call"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    error = _error(
        httpx.post(server.url + CHAT_ROUTE, json=_chat_body(image), timeout=HTTP_TIMEOUT_S), 400
    )
    assert error["param"] == "messages.0.content"
    assert error["message"] == (
        "messages.0.content: block 0 is of type 'image_url': this model takes only 'text' content"
    )
    for fields, param in [
        ({"suffix": "!"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"min_tokens": 3}, "min_tokens"),
    ]:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields}
        assert (
            _error(httpx.post(server.url + CMPL_ROUTE, json=body, timeout=HTTP_TIMEOUT_S), 400)[
                "param"
            ]
            == param
        )
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).chat.completions.create(
            model=MODEL,
            messages=EOS_CHAT,  # type: ignore[arg-type]
            functions=[{"name": "f", "parameters": {"type": "object"}}],
        )
    assert info.value.param == "functions"
    # At their defaults, the same fields ask for nothing.
    r = httpx.post(
        server.url + CHAT_ROUTE,
        json=_chat_body(
            EOS_CHAT,
            max_tokens=2,
            tools=[],
            tool_choice="none",
            response_format={"type": "text"},
            logit_bias={},
            presence_penalty=0,
            repetition_penalty=1.0,
            min_p=0,
        ),
        timeout=HTTP_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": False, "best_of": 1}
    assert httpx.post(server.url + CMPL_ROUTE, json=body, timeout=HTTP_TIMEOUT_S).status_code == 200
    _assert_answers(server)


def test_body_too_large(server: LiveServer) -> None:
    padding = "a" * (8 * 2**20 + 1)
    body = json.dumps(_chat_body(EOS_CHAT, user=padding)).encode()
    r = httpx.post(
        server.url + CHAT_ROUTE,
        content=body,
        headers={"content-type": "application/json"},
        timeout=HTTP_TIMEOUT_S,
    )
    error = _error(r, 413)
    assert error["code"] == "request_too_large"

    # Without a Content-Length (chunked), the limit holds while reading.
    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    r = httpx.post(
        server.url + CMPL_ROUTE,
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert "content-length" not in r.request.headers
    assert _error(r, 413)["code"] == "request_too_large"
    _assert_answers(server)


def test_unknown_path_and_wrong_method(server: LiveServer) -> None:
    error = _error(httpx.post(server.url + "/v1/nothing", json={}, timeout=HTTP_TIMEOUT_S), 404)
    assert error == {
        "message": "invalid URL (POST /v1/nothing)",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    r = httpx.get(server.url + CHAT_ROUTE, timeout=HTTP_TIMEOUT_S)
    assert _error(r, 405)["type"] == "invalid_request_error"
    assert r.headers["allow"] == "POST"
    _assert_answers(server)


def test_overloaded_is_429_with_retry_after(
    model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("openai-overload")
    with live_server(tmp, "--ttft-target", "0.000001", model_folder=model_folder) as s:
        with pytest.raises(openai.RateLimitError) as info:
            _client(s).chat.completions.create(model=MODEL, messages=EOS_CHAT, max_tokens=4)
        assert info.value.status_code == 429
        # max(1, ceil(predicted TTFT - target)): a short prompt is a second or two away.
        retry_after = info.value.response.headers["retry-after"]
        assert retry_after in admission_retry_after(info.value.message, 0.000001)
        body = info.value.body
        assert isinstance(body, dict) and set(body) == ERROR_KEYS
        assert body["type"] == "server_error" and body["code"] == "overloaded"
        r = httpx.post(
            s.url + CMPL_ROUTE, json={"model": MODEL, "prompt": PROMPT}, timeout=HTTP_TIMEOUT_S
        )
        refused = _error(r, 429)
        assert refused["code"] == "overloaded"
        assert r.headers["retry-after"] in admission_retry_after(refused["message"], 0.000001)
        # Refused, not broken: still healthy, and nothing was queued.
        assert httpx.get(s.url + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200
        _wait_for_gauges(s)
        assert s.metric("tokenfleet_num_requests_waiting") == 0


def test_engine_down_is_503_then_recovers(spare_server: LiveServer, ref: Reference) -> None:
    expected = ref.chat(EOS_CHAT, 40)
    client = _client(spare_server)
    body = _chat_body(EOS_CHAT, max_tokens=40, temperature=0)

    # A stream in flight when the engine dies ends with an error event, not [DONE].
    stream = client.chat.completions.create(
        model=MODEL,
        messages=LONG_CHAT,
        max_tokens=1000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert next(iter(stream)).choices[0].delta.role == "assistant"
    old_pid = spare_server.engine_pid()
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine"):
        for _ in stream:
            pass

    # Requests get 503 in OpenAI's format until the engine is back. The new engine takes
    # seconds to load and profile its model, long after the first 503 (the poll's bound
    # only catches a gateway that never notices), and the second request below is sent
    # right after it.
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while True:
        r = httpx.post(spare_server.url + CHAT_ROUTE, json=body, timeout=HTTP_TIMEOUT_S)
        if r.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    error = _error(r, 503)
    assert error["type"] == "server_error" and error["code"] == "engine_unavailable"
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=EOS_CHAT, max_tokens=4)
    assert info.value.status_code == 503

    # The gateway restarts the engine on its own.
    spare_server.wait_healthy(timeout=120)
    assert spare_server.engine_pid() != old_pid
    r = client.chat.completions.create(model=MODEL, messages=EOS_CHAT, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == expected.text
    assert r.usage is not None and r.usage.completion_tokens == len(expected.token_ids)


# -- 9. metrics -------------------------------------------------------------------------------


def test_metrics(server: LiveServer) -> None:
    client = _client(server)
    before_prompt = server.metric("tokenfleet_prompt_tokens_total")
    before_generated = server.metric("tokenfleet_generation_tokens_total")
    # The engine's own first-token time beside the gateway's, for the same request.
    engine_ttft = "tokenfleet_engine_time_to_first_token_seconds"
    gateway_ttft = "tokenfleet_time_to_first_token_seconds"
    gateway_labels = {"route": CHAT_ROUTE, "priority": "interactive"}

    def ttft_sums() -> tuple[float, float, float]:
        samples = _samples(server)

        def value(name: str, labels: dict[str, str]) -> float:
            return sum(v for n, lab, v in samples if n == name and lab == labels)

        return (
            value(engine_ttft + "_count", {"class": "interactive"}),
            value(engine_ttft + "_sum", {"class": "interactive"}),
            value(gateway_ttft + "_sum", gateway_labels),
        )

    before_ttft = ttft_sums()
    r = client.chat.completions.create(model=MODEL, messages=EOS_CHAT, max_tokens=40, temperature=0)
    assert r.usage is not None
    assert server.metric("tokenfleet_prompt_tokens_total") - before_prompt == r.usage.prompt_tokens
    generated = server.metric("tokenfleet_generation_tokens_total") - before_generated
    assert generated == r.usage.completion_tokens
    count, engine_s, gateway_s = (a - b for a, b in zip(ttft_sums(), before_ttft, strict=True))
    assert count == 1
    assert 0 < engine_s < gateway_s  # the gateway's first token includes the engine's

    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    for route in (CHAT_ROUTE, CMPL_ROUTE):
        labels = {"route": route, "priority": "interactive"}
        for histogram in (
            "tokenfleet_time_to_first_token_seconds",
            "tokenfleet_time_per_output_token_seconds",
            "tokenfleet_e2e_request_latency_seconds",
        ):
            assert _labelled(server, histogram + "_count", labels) > 0, (histogram, route)
            assert _labelled(server, histogram + "_sum", labels) > 0, (histogram, route)
            inf = _labelled(server, histogram + "_bucket", {**labels, "le": "+Inf"})
            assert inf == _labelled(server, histogram + "_count", labels)
    assert server.metric("tokenfleet_kv_blocks_total") > 0
    assert server.metric("tokenfleet_kv_blocks_used") == 0
    assert server.metric("tokenfleet_num_requests_running") == 0
    assert server.metric("tokenfleet_num_requests_waiting") == 0
    assert 0 <= server.metric("tokenfleet_prefix_cache_hit_rate") <= 1


# -- 10. a client that goes away --------------------------------------------------------------


def _blocks_freed(server: LiveServer) -> bool:
    return (
        server.metric("tokenfleet_kv_blocks_used") == 0
        and server.metric("tokenfleet_num_requests_running") == 0
    )


def test_disconnect_frees_blocks(server: LiveServer) -> None:
    """A stream closed after a few tokens of 1000 is aborted: its blocks are freed and its
    generation stops short. (Run to its end it would free them too: what shows the abort
    is the token count, not how soon; the wait's bound only catches a hang.)"""
    assert server.metric("tokenfleet_kv_blocks_used") == 0
    assert server.metric("tokenfleet_num_requests_running") == 0
    start = server.metric(GENERATED_TOKENS)
    body = _chat_body(LONG_CHAT, max_tokens=1000, temperature=0, stream=True, ignore_eos=True)
    with (
        httpx.Client(timeout=HTTP_TIMEOUT_S) as http,
        http.stream("POST", server.url + CHAT_ROUTE, json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(12):  # a few events (with their blank separator lines)
            next(lines)
        # Stats come with every engine step, so these are the stream's own.
        assert server.metric("tokenfleet_kv_blocks_used") > 0
        assert server.metric("tokenfleet_num_requests_running") == 1
    # The connection is closed: the request is aborted and its blocks freed.
    _wait_for(lambda: _blocks_freed(server), 120, "blocks freed after the disconnect")
    assert 0 < server.metric(GENERATED_TOKENS) - start < 1000  # stopped early
    # Nothing left half-done: the next request is served normally.
    _assert_answers(server)


def test_disconnect_frees_blocks_of_a_request_not_streamed(server: LiveServer) -> None:
    """A client that gives up on a long non-streamed completion (it hangs up once the
    server is generating): its generation is aborted, not run to max_tokens for no one."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
    start = server.hang_up_once_generating(CMPL_ROUTE, body)
    _wait_for(lambda: _blocks_freed(server), 120, "blocks freed after the disconnect")
    stopped = server.metric(GENERATED_TOKENS)
    assert 0 < stopped - start < 1000  # it ran, and it was stopped early
    _assert_answers(server)  # two tokens, and none more of the aborted request
    assert server.metric(GENERATED_TOKENS) == stopped + 2
