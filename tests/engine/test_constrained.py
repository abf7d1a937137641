"""Constrained decoding (SamplingParams.constraint) with the real model: every output fits
its JSON schema, JSON object, regex or Lark grammar and ends with "stop" once complete (or
"length" at max_tokens first); a constraint that cannot be compiled, or not in time, fails
its request alone; unconstrained rows beside constrained ones give their own tokens; a
resumed constrained request replays its earlier outputs into its matcher and goes on token
for token; logprobs stay the model's own; stop token ids end a row where EOS could."""

from __future__ import annotations

import itertools
import json
import re
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import jsonschema
import msgspec
import pytest
import torch
from support.engine_streams import Stream, run_streams

from tokenfleet import SamplingParams
from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.config import CacheConfig, EngineConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.sampling_params import Constraint
from tokenfleet.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenfleet.engine.core import EngineCore
from tokenfleet.errors import InvalidRequestError
from tokenfleet.models.config import ModelConfig
from tokenfleet.policy.step_model import StepModelConfig
from tokenfleet.runner.grammar import Matchers

BLOCK_SIZE = 16
NUM_BLOCKS = 64
EOS = 2

# The named schemas: an enum; a bounded string and a number; a nested array with maxItems.
ENUM = {
    "type": "object",
    "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
    "required": ["sentiment"],
    "additionalProperties": False,
}
BOUNDED = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 20},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["title", "score"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
SCHEMAS = {
    "enum": (ENUM, "Is this review positive or negative? 'I loved this movie!' Answer in JSON."),
    "bounded": (BOUNDED, "Give a title and a score from 0 to 10 for a movie, as JSON."),
    "nested": (NESTED, "List two fruits with quantities as JSON."),
}
REGEX = r"[0-9]{1,3}"
# A tool call's syntax: markup around arguments that fit a JSON schema.
TOOL_CALL = (
    'start: "<tool_call>" args "</tool_call>"\n'
    'args: %json {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},'
    ' "required": ["city"], "additionalProperties": false}\n'
)


def _schema(schema: dict[str, Any]) -> Constraint:
    return Constraint("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def core(model_folder: Path) -> EngineCore:
    kv_bytes = ModelConfig.from_folder(model_folder).kv_bytes_per_token(4)  # float32
    cache = CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=kv_bytes * BLOCK_SIZE * NUM_BLOCKS)
    return EngineCore(
        EngineConfig(model=str(model_folder), cache=cache),
        step_model_config=StepModelConfig(profile=False),
    )


@pytest.fixture(scope="module")
def tokenizer(core: EngineCore) -> Tokenizer:
    return Tokenizer(core.model_folder)


def _chat(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


_ids = itertools.count()


def _request(
    prompt: list[int], params: SamplingParams, earlier: list[int] | None = None
) -> EngineCoreRequest:
    return EngineCoreRequest(f"c{next(_ids)}", prompt, params, 0.0, output_token_ids=earlier or [])


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> list[Stream]:
    """Each request's stream, all added before the first step (batched together)."""
    streams = run_streams(core, requests)
    assert not core.matchers
    return streams


def _params(
    constraint: Constraint | None, seed: int | None = None, **fields: Any
) -> SamplingParams:
    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": seed} if seed is not None else {}
    return SamplingParams(
        **{"max_tokens": 64, "temperature": 0, "constraint": constraint, **sampled, **fields}
    )


class Batch(NamedTuple):
    streams: dict[str, Stream]
    plain_alone: Stream


@pytest.fixture(scope="module")
def batch(core: EngineCore, tokenizer: Tokenizer) -> Batch:
    """One batch, every kind of row in the same steps: each named schema greedy and seeded,
    any JSON object, a regex, a tool-call grammar, a schema cut by max_tokens, an
    unsupported schema, and an unconstrained greedy request (also run alone)."""
    plain_prompt = _chat(tokenizer, "Write a short poem about the sea.")
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    requests: dict[str, EngineCoreRequest] = {}
    for name, (schema, text) in SCHEMAS.items():
        prompt = _chat(tokenizer, text)
        requests[f"{name}/greedy"] = _request(prompt, _params(_schema(schema), logprobs=1))
        requests[f"{name}/seeded"] = _request(prompt, _params(_schema(schema), seed=5))
    requests["json_object"] = _request(
        _chat(tokenizer, "What is the capital of France? Answer as a JSON object."),
        _params(Constraint("json_object")),
    )
    requests["regex"] = _request(
        _chat(tokenizer, "What is 12 times 12?"), _params(Constraint("regex", REGEX))
    )
    requests["tool_call"] = _request(
        _chat(tokenizer, "Call the weather tool for Paris."),
        _params(Constraint("grammar", TOOL_CALL)),
    )
    requests["length"] = _request(
        _chat(tokenizer, SCHEMAS["nested"][1]), _params(_schema(NESTED), max_tokens=6)
    )
    unsupported = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    requests["unsupported"] = _request(plain_prompt, _params(_schema(unsupported)))
    requests["plain"] = _request(plain_prompt, plain)
    streams = _run(core, list(requests.values()))
    (plain_alone,) = _run(core, [_request(plain_prompt, plain)])
    return Batch(dict(zip(requests, streams, strict=True)), plain_alone)


def _text(tokenizer: Tokenizer, stream: Stream) -> str:
    return tokenizer.decode(stream.tokens)


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_json_schema_outputs_parse_validate_and_stop(
    batch: Batch, tokenizer: Tokenizer, name: str, mode: str
) -> None:
    """Greedy and seeded (temperature 0.8, top_p 0.95) outputs of each named schema parse,
    validate, and end with "stop" the step their JSON closes: no EOS after it."""
    stream = batch.streams[f"{name}/{mode}"]
    value = json.loads(_text(tokenizer, stream))
    jsonschema.validate(value, SCHEMAS[name][0])
    assert stream.finish_reason == "stop" and stream.stop_token_id is None
    assert EOS not in stream.tokens and stream.error is None


def test_json_object_regex_and_tool_call_grammar(batch: Batch, tokenizer: Tokenizer) -> None:
    """Any JSON object parses as an object; the regex's output matches it whole; the Lark
    tool-call grammar's output is its markup around arguments that fit their schema."""
    obj = batch.streams["json_object"]
    assert obj.finish_reason == "stop" and isinstance(json.loads(_text(tokenizer, obj)), dict)
    regex = batch.streams["regex"]
    assert regex.finish_reason == "stop" and re.fullmatch(REGEX, _text(tokenizer, regex))
    call = batch.streams["tool_call"]
    match = re.fullmatch(r"<tool_call>(.*)</tool_call>", _text(tokenizer, call), re.DOTALL)
    assert call.finish_reason == "stop" and match is not None
    args = json.loads(match.group(1))
    assert isinstance(args["city"], str) and set(args) == {"city"}


def test_max_tokens_before_the_grammar_completes_ends_with_length(
    batch: Batch, tokenizer: Tokenizer
) -> None:
    """Cut at 6 tokens, the nested schema's output is the start of the uncut greedy one."""
    cut = batch.streams["length"]
    assert cut.finish_reason == "length" and len(cut.tokens) == 6
    assert cut.tokens == batch.streams["nested/greedy"].tokens[:6]


def test_an_unsupported_schema_fails_its_request_alone(batch: Batch) -> None:
    """uniqueItems, which llguidance does not implement, is named in the error; the rows
    beside it complete."""
    failed = batch.streams["unsupported"]
    assert failed.finish_reason == "error" and failed.tokens == []
    assert failed.error == (
        "constraint: the JSON schema is not supported or not valid: "
        'Unimplemented keys: ["uniqueItems"]'
    )
    assert all(
        s.finish_reason in ("stop", "length")
        for k, s in batch.streams.items()
        if k != "unsupported"
    )


def test_an_unconstrained_row_beside_constrained_ones_gives_its_own_tokens(batch: Batch) -> None:
    assert batch.streams["plain"].tokens == batch.plain_alone.tokens
    assert len(batch.plain_alone.tokens) == 24


def test_logprobs_of_a_constrained_row_are_the_models_own(
    batch: Batch, tokenizer: Tokenizer
) -> None:
    """The first token of the enum schema's output is forced ('{'); its reported logprob
    is the model's, below the model's own top choice, which the grammar did not allow."""
    stream = batch.streams["enum/greedy"]
    assert [e.token_id for e in stream.logprobs] == stream.tokens
    first = stream.logprobs[0]
    assert tokenizer.decode([first.token_id]).startswith("{")
    ((top_id, top_logprob),) = first.top
    assert top_id != first.token_id and top_logprob > first.logprob
    assert all(e.logprob <= 0 for e in stream.logprobs)


def test_a_resumed_constrained_request_goes_on_token_for_token(
    core: EngineCore, tokenizer: Tokenizer, batch: Batch
) -> None:
    """Greedy and seeded, moved 6 tokens before their end (the earlier outputs replayed
    into a fresh matcher), the nested schema's requests give the rest of the unmoved
    streams and end as they did."""
    prompt = _chat(tokenizer, SCHEMAS["nested"][1])
    unmoved, requests = [], []
    for mode, seed in (("greedy", None), ("seeded", 5)):
        stream = batch.streams[f"nested/{mode}"]
        k = len(stream.tokens) - 6
        unmoved.append((stream, k))
        requests.append(_request(prompt, _params(_schema(NESTED), seed=seed), stream.tokens[:k]))
    for (stream, k), resumed in zip(unmoved, _run(core, requests), strict=True):
        assert stream.tokens[:k] + resumed.tokens == stream.tokens
        assert resumed.finish_reason == "stop" and resumed.stop_token_id is None


def test_a_resume_whose_earlier_outputs_break_the_constraint_fails(
    core: EngineCore, tokenizer: Tokenizer
) -> None:
    prompt = _chat(tokenizer, "Say hi.")
    hello = tokenizer.encode("Hello")
    (stream,) = _run(core, [_request(prompt, _params(_schema(ENUM)), hello)])
    assert stream.finish_reason == "error" and stream.error is not None
    assert stream.error.startswith(
        f"constraint: its earlier output token 0 (id {hello[0]}) does not fit its constraint"
    )


def test_a_compiled_spec_is_cached_and_admitted_at_once(core: EngineCore) -> None:
    """The second compile of a spec is the first one's future, done; a request with a
    compiled spec enters the scheduler in add_request, with no step between."""
    assert core.grammar is not None
    constraint = _schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    first = core.grammar.compile(constraint)
    first.result()
    assert core.grammar.compile(Constraint("json_schema", constraint.spec)) is first
    request = _request([1, 2, 3], _params(constraint, max_tokens=2))
    core.add_request(request)
    assert request.req_id in core.scheduler.requests and request.req_id in core.matchers
    core.abort([request.req_id])
    (out,) = core.step().outputs
    assert out.finish_reason == "abort" and not core.matchers


@pytest.mark.parametrize(
    "constraint, error",
    [
        (Constraint("regex", "[a-"), "constraint: the regex is not supported or not valid: "),
        (Constraint("grammar", "start: foo"), 'unknown name: "foo"'),
        (_schema({"type": "strin"}), "Invalid type: strin"),
    ],
    ids=["regex", "grammar", "schema"],
)
def test_a_constraint_that_does_not_compile_fails_its_request(
    core: EngineCore, constraint: Constraint, error: str
) -> None:
    (stream,) = _run(core, [_request([1, 2, 3], _params(constraint))])
    assert stream.finish_reason == "error" and stream.tokens == []
    assert stream.error is not None and error in stream.error


@pytest.mark.fake("a compile that never ends: a Future never completed")
def test_a_compile_past_its_time_limit_fails_its_request_and_stalls_no_one(
    core: EngineCore, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose compile never ends waits out of the scheduler while a plain request
    beside it runs to its end, then fails with the limit named."""
    assert core.grammar is not None
    monkeypatch.setattr(core, "config", replace(core.config, grammar_compile_timeout_s=0.5))
    stuck: Future[Any] = Future()
    monkeypatch.setattr(core.grammar, "compile", lambda constraint: stuck)
    slow = _request([1, 2, 3], _params(Constraint("json_object")))
    core.add_request(slow)
    assert not core.has_step_work() and core.stats().num_waiting == 1
    plain = _request(_chat(tokenizer, "Say hi."), SamplingParams(max_tokens=3, temperature=0))
    core.add_request(plain)
    outputs = []
    while core.has_unfinished_requests():
        outputs += [(o.req_id, o.finish_reason, o.error) for o in core.step().outputs]
    assert [o[1] for o in outputs if o[0] == plain.req_id] == [None, None, "length"]
    limit = "constraint: compiling it took over the limit of 0.5 s"
    assert [o for o in outputs if o[0] == slow.req_id] == [(slow.req_id, "error", limit)]
    assert core.kv.pool.num_used_blocks == 0
    assert not core.has_step_work() and not core.has_unfinished_requests()


def test_stop_token_ids_are_allowed_where_the_grammar_may_end(core: EngineCore) -> None:
    """A stop token id of a constrained row is masked as EOS is: disallowed before the
    regex matches, allowed once it may end; other tokens as the grammar says."""
    assert core.grammar is not None
    template = core.grammar.compile(Constraint("regex", "[0-9]+")).result()
    vocab = core.model_config.vocab_size
    matchers = Matchers(vocab, [EOS])
    (stop,), (digit,), (letter,) = (core.grammar.tokenizer.tokenize_str(t) for t in ".7a")
    matchers.add("r", template, SamplingParams(stop_token_ids=(stop,)))
    step = SchedulerOutput(
        [ScheduledRequest("r", [1], 0, [0], True, True, SamplingParams())], frozenset(), ()
    )

    def disallowed() -> list[bool]:
        masks = matchers.start_fill(step)
        assert masks is not None
        masked, failed = masks.apply(torch.zeros(1, vocab), ["r"], [False])
        assert failed == {}
        return [bool(masked[0, t] == float("-inf")) for t in (EOS, stop, digit, letter)]

    assert disallowed() == [True, True, False, True]
    assert matchers.advance({"r": digit}, ["r"]) == (set(), {})
    assert disallowed() == [False, False, False, True]
    assert matchers.advance({"r": stop}, ["r"]) == (set(), {})  # not consumed: it ends
    assert matchers.advance({"r": EOS}, ["r"]) == ({"r"}, {})
    matchers.close()


def test_masks_launched_before_the_matchers_advance_fill_after_it_without_ended_rows(
    core: EngineCore,
) -> None:
    """The overlap's masks (Matchers.fill_later): made before the step before has been
    consumed, filled after it (PendingFill.start) from the matchers' new state, rows of
    requests ended there left out; a failure reaches the forward that waits for them."""
    assert core.grammar is not None
    template = core.grammar.compile(Constraint("regex", "[0-9]+")).result()
    vocab = core.model_config.vocab_size
    matchers = Matchers(vocab, [EOS])
    (digit,) = core.grammar.tokenizer.tokenize_str("7")
    for req_id in ("a", "b"):
        matchers.add(req_id, template, SamplingParams())
    step = SchedulerOutput(
        [
            ScheduledRequest(r, [1], 0, [0], True, True, SamplingParams())
            for r in ("a", "b", "free")
        ],
        frozenset(),
        (),
    )
    assert matchers.fill_later(step, skip={"a", "b"}) is None  # no constrained row left
    pending = matchers.fill_later(step, skip={"b"})
    assert pending is not None
    assert matchers.advance({"a": digit}, ["a"]) == (set(), {})
    pending.start(ended=set())
    assert pending.masks.req_ids == ["a"]
    masked, failed = pending.masks.apply(torch.zeros(3, vocab), ["a", "b", "free"], [False] * 3)
    assert failed == {}
    # After a digit the regex may end: EOS allowed (before the advance it was not).
    assert masked[0, EOS] == 0 and masked[0, digit] == 0
    assert bool((masked[1:] == 0).all())  # rows without masks untouched
    ended = matchers.fill_later(step)
    assert ended is not None
    ended.start(ended={"a", "b"})
    assert ended.masks.req_ids == []
    logits = torch.ones(3, vocab)
    assert ended.masks.apply(logits, ["a", "b", "free"], [False] * 3) == (logits, {})
    failing = matchers.fill_later(step)
    assert failing is not None
    failing.fail(RuntimeError("advance failed"))
    with pytest.raises(RuntimeError, match="advance failed"):
        failing.masks.wait()
    matchers.close()


def test_a_constraint_is_checked_on_the_wire() -> None:
    """Its kind, a spec where one is needed (valid JSON, an object, for a schema), none for
    json_object, and a size limit: each refused with param "constraint"; decoded from the
    wire it is the same struct."""
    cases = [
        (lambda: Constraint("yaml", "x"), "kind must be one of"),  # type: ignore[arg-type]
        (lambda: Constraint("regex"), "a regex constraint needs a spec"),
        (lambda: Constraint("json_object", "{}"), "takes no spec"),
        (lambda: Constraint("json_schema", "{bad"), "the JSON schema is not valid JSON"),
        (lambda: Constraint("json_schema", "[1]"), "must be a JSON object"),
        (lambda: Constraint("grammar", "x" * ((1 << 17) + 1)), "over the limit of 131072"),
    ]
    for make, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as info:
            make()
        assert info.value.param == "constraint"
    params = SamplingParams(constraint=Constraint("regex", "a+"))
    wire = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(wire, type=SamplingParams) == params
    assert msgspec.msgpack.decode(wire) == {"constraint": {"kind": "regex", "spec": "a+"}}


@pytest.mark.fake("the fixed runner")
def test_the_fixed_runner_refuses_a_constraint(model_folder: Path) -> None:
    fixed = EngineCore(
        EngineConfig(model=str(model_folder), runner="fixed"),
        step_model_config=StepModelConfig(profile=False),
    )
    assert fixed.grammar is None
    with pytest.raises(InvalidRequestError, match="fixed runner") as info:
        fixed.add_request(_request([1, 2, 3], _params(Constraint("json_object"))))
    assert info.value.param == "constraint"
