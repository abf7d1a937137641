"""Structured output through the official clients, on a real server with the real model:
OpenAI `response_format` (`chat.completions.parse` with a pydantic model, streamed and
not, `json_object`) and Anthropic `output_config` (`messages.parse(output_format=...)`,
streamed and not), in both Batch APIs, in `count_tokens`; 400s naming what a schema asks
that the grammar library does not implement; and the prefix cache's usage fields, exact.

Each answer is also the in-process engine's greedy answer under the same constraint: the
API passes on exactly the schema it was sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel, Field, ValidationError
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server
from support.tools import openai_batch_results

from tokenfleet import LLM, SamplingParams
from tokenfleet.config import CacheConfig
from tokenfleet.core.sampling_params import Constraint

pytestmark = pytest.mark.slow

MAX_TOKENS = 120
BLOCK_SIZE = CacheConfig().block_size


# The named set of schemas: an enum; a bounded string and a number; a nested array with
# maxItems.
class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]


class Review(BaseModel):
    summary: str = Field(max_length=40)
    score: int = Field(ge=0, le=10)


class Entity(BaseModel):
    name: str = Field(max_length=20)
    kind: Literal["person", "place", "thing"]


class Entities(BaseModel):
    entities: list[Entity] = Field(max_length=3)


SCHEMAS: dict[str, type[BaseModel]] = {
    "sentiment": Sentiment,
    "review": Review,
    "entities": Entities,
}
TEXTS = [
    "I loved this film, the acting was wonderful.",
    "The food was cold and the waiter was rude.",
    "Marie Curie worked in Paris with a microscope.",
    "The train left on time and arrived on time.",
]


def messages_for(name: str, text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give the {name} of this text as JSON: {text}"}]


@pytest.fixture(scope="module")
def server(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("structured"), model_folder=model_folder) as s:
        yield s


@pytest.fixture(scope="module")
def llm(model_folder: Path) -> LLM:
    """The in-process engine, one thread as the server's."""
    return LLM(str(model_folder), kv_cache_memory=64 << 20, num_threads=1)


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
    )


def anthropic_client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
    )


def engine_answer(llm: LLM, messages: list[dict[str, str]], schema: dict[str, Any]) -> str:
    constraint = Constraint("json_schema", json.dumps(schema, separators=(",", ":")))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, constraint=constraint)
    return llm.chat([messages], params)[0].text


def openai_strict_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The schema the openai client sends for `model` (`parse`'s own conversion)."""
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(model)


# -- OpenAI response_format --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_openai_parse_streamed_and_not_gives_the_engines_json(
    server: LiveServer, llm: LLM, name: str
) -> None:
    """`chat.completions.parse(response_format=Model)`: a `parsed` instance of the model,
    finish "stop", the content the engine's greedy answer under the schema the client
    sent; `chat.completions.stream` gives the same content and parsed value."""
    model, messages = SCHEMAS[name], messages_for(name, TEXTS[0])
    client = openai_client(server)
    kwargs: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}
    completion = client.chat.completions.parse(response_format=model, temperature=0, **kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)
    assert choice.message.content == engine_answer(llm, messages, openai_strict_schema(model))
    with client.chat.completions.stream(response_format=model, temperature=0, **kwargs) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.content == choice.message.content
    assert final.choices[0].message.parsed == choice.message.parsed


def test_openai_json_object_needs_json_in_the_messages(server: LiveServer) -> None:
    """`json_object`: the content is one JSON object; without the word JSON in the
    messages, OpenAI's own 400."""
    client = openai_client(server)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply in JSON: what is the capital of France?"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert answer.choices[0].finish_reason == "stop"
    assert json.loads(answer.choices[0].message.content or "") == {"capital": "Paris"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a cat."}],
            max_tokens=MAX_TOKENS,
            response_format={"type": "json_object"},
        )
    assert refused.value.body == {
        "message": "'messages' must contain the word 'json' in some form, to use "
        "'response_format' of type 'json_object'.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }


UNSUPPORTED = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
}


def test_a_schema_feature_not_implemented_is_a_400_naming_it_on_both_apis(
    server: LiveServer,
) -> None:
    """uniqueItems: a 400 in each API's own format naming it, from create and from
    Anthropic's count_tokens alike; a schema that is not a JSON object is a 400 too."""
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tags as JSON"}],
            max_tokens=MAX_TOKENS,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "tags", "schema": UNSUPPORTED, "strict": True},
            },
        )
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "response_format.json_schema.schema"
    assert 'Unimplemented keys: ["uniqueItems"]' in body["message"]
    client = anthropic_client(server)
    output_config: Any = {"format": {"type": "json_schema", "schema": UNSUPPORTED}}
    messages: Any = [{"role": "user", "content": "Tags as JSON"}]
    with pytest.raises(anthropic.BadRequestError) as refused_too:
        client.messages.create(
            model=MODEL, max_tokens=MAX_TOKENS, messages=messages, output_config=output_config
        )
    with pytest.raises(anthropic.BadRequestError) as counted:
        client.messages.count_tokens(model=MODEL, messages=messages, output_config=output_config)
    for error in (refused_too.value, counted.value):
        assert error.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        message = error.body["error"]["message"]  # type: ignore[index]
        assert message.startswith("output_config.format.schema: the schema is not supported")
        assert 'Unimplemented keys: ["uniqueItems"]' in message
    reply = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}},
        },
        timeout=HTTP_TIMEOUT_S,
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "response_format.json_schema.json_schema.schema"


# -- Anthropic output_config -------------------------------------------------------------------


def test_anthropic_parse_streamed_and_not_gives_the_engines_json(
    server: LiveServer, llm: LLM
) -> None:
    """`messages.parse(output_format=Model)`: the text block holds the engine's greedy
    JSON under the schema the client sent, `parsed_output` an instance of the model,
    stop_reason end_turn; `messages.stream(output_format=Model)` the same. (The client
    moves bounds such as maxLength out of the schema it sends, into descriptions, as
    Anthropic's API takes none: the enum schema is the one whose bounds survive.)"""
    messages = messages_for("sentiment", TEXTS[1])
    client = anthropic_client(server)
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": messages}
    extra = {"extra_body": {"temperature": 0}}
    message = client.messages.parse(output_format=Sentiment, **kwargs, **extra)
    assert message.stop_reason == "end_turn"
    block = message.content[0]
    assert block.type == "text" and isinstance(block.parsed_output, Sentiment)
    assert block.text == engine_answer(llm, messages, anthropic_sent_schema(Sentiment))
    with client.messages.stream(output_format=Sentiment, **kwargs, **extra) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == block.text
    assert final.content[0].parsed_output == block.parsed_output


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_anthropic_output_config_with_bounds_streamed_and_not(
    server: LiveServer, llm: LLM, name: str
) -> None:
    """`output_config` given the whole schema, bounds included (this server enforces
    them), objects closed as Anthropic's API asks: the engine's greedy JSON, which
    validates against the model, streamed and not; count_tokens with the output_config
    counts the prompt alone."""
    model, messages = SCHEMAS[name], messages_for(name, TEXTS[2])
    schema = closed(model.model_json_schema())
    output_config: Any = {"format": {"type": "json_schema", "schema": schema}}
    client = anthropic_client(server)
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": messages}
    kwargs |= {"output_config": output_config, "extra_body": {"temperature": 0}}
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "end_turn" and message.content[0].type == "text"
    text = message.content[0].text
    assert text == engine_answer(llm, messages, schema)
    model.model_validate_json(text)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == text
    counted = client.messages.count_tokens(
        model=MODEL, messages=messages, output_config=output_config
    )
    plain = client.messages.count_tokens(model=MODEL, messages=messages)
    assert counted.input_tokens == plain.input_tokens


def closed(node: Any) -> Any:
    """The schema with `additionalProperties: false` on every object (else a small model
    adds keys of its own until max_tokens)."""
    if isinstance(node, list):
        return [closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: closed(v) for k, v in node.items()}
    return out | {"additionalProperties": False} if out.get("type") == "object" else out


def anthropic_sent_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The schema `messages.parse(output_format=model)` sends (the client's own
    transform)."""
    from anthropic.lib._parse._transform import transform_schema
    from pydantic import TypeAdapter

    return transform_schema(TypeAdapter(model).json_schema())


# -- both Batch APIs ----------------------------------------------------------------------------

NUM_BATCH = 500


def test_a_batch_of_500_classifications_every_result_parses_and_validates(
    server: LiveServer,
) -> None:
    """500 OpenAI batch requests over the three schemas: every result succeeded, ended by
    "stop" and validates against its schema; a result that ended by "length" (cut off) or
    does not validate counts as a failure, and there are none."""
    client = openai_client(server)
    names = list(SCHEMAS)
    bodies: dict[str, dict[str, Any]] = {}
    for n in range(NUM_BATCH):
        name = names[n % len(names)]
        body = {
            "model": MODEL,
            "messages": messages_for(name, f"{TEXTS[n % len(TEXTS)]} (item {n})"),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": name,
                    "schema": openai_strict_schema(SCHEMAS[name]),
                    "strict": True,
                },
            },
        }
        bodies[f"{name}-{n}"] = body
    results = list(openai_batch_results(client, bodies, 900).values())
    failures: dict[str, str] = {}
    for result in results:
        name = result["custom_id"].split("-")[0]
        choice = result["response"]["body"]["choices"][0]
        if choice["finish_reason"] != "stop":
            failures[result["custom_id"]] = f"ended by {choice['finish_reason']}"
            continue
        try:
            SCHEMAS[name].model_validate_json(choice["message"]["content"])
        except ValidationError as exc:
            failures[result["custom_id"]] = str(exc)
    assert failures == {}, f"{len(failures)} of {NUM_BATCH} failed: {failures}"


def test_an_anthropic_batch_with_output_config_and_a_refused_one(
    server: LiveServer, llm: LLM
) -> None:
    """Anthropic's Batch API: a batch with a request whose schema asks for uniqueItems is
    refused at creation with a 400 naming the request, the field and the keyword; the
    batch without it succeeds, each result the sync answer's JSON."""
    client = anthropic_client(server)
    schema = anthropic_sent_schema(Sentiment)
    requests: list[Any] = [
        {
            "custom_id": f"ok-{n}",
            "params": {
                "model": MODEL,
                "max_tokens": MAX_TOKENS,
                "messages": messages_for("sentiment", text),
                "temperature": 0,
                "output_config": {"format": {"type": "json_schema", "schema": schema}},
            },
        }
        for n, text in enumerate(TEXTS)
    ]
    bad = {"format": {"type": "json_schema", "schema": UNSUPPORTED}}
    refused = [
        *requests,
        {"custom_id": "bad", "params": {**requests[0]["params"], "output_config": bad}},
    ]
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.batches.create(requests=refused)
    assert error.value.body["error"]["message"] == (  # type: ignore[index]
        f"requests[{len(TEXTS)}].params.output_config.format.schema: the schema is not "
        'supported: Unimplemented keys: ["uniqueItems"]'
    )
    batch = client.messages.batches.create(requests=requests)
    deadline = time.monotonic() + 300
    while client.messages.batches.retrieve(batch.id).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert sorted(results) == [f"ok-{n}" for n in range(len(TEXTS))]
    for n, text in enumerate(TEXTS):
        result = results[f"ok-{n}"]
        assert result.type == "succeeded"
        block = result.message.content[0]
        assert block.type == "text"
        assert block.text == engine_answer(llm, messages_for("sentiment", text), schema)
        Sentiment.model_validate_json(block.text)


# -- the prefix cache's usage fields --------------------------------------------------------


def test_cached_prompt_tokens_are_reported_exactly_on_both_apis(
    model_folder: Path, llm: LLM, tmp_path: Path
) -> None:
    """On a fresh server: a first request caches nothing; a second sharing a long prefix
    with it reads the shared prefix's whole blocks from the cache, and says so exactly:
    OpenAI `prompt_tokens_details.cached_tokens`, Anthropic `cache_read_input_tokens`
    (with `input_tokens` the rest of the prompt, `cache_creation_input_tokens` 0), streamed
    and not."""
    shared = "Here is a long shared context. " * 12
    first = [{"role": "user", "content": shared + "Question one: what is it?"}]
    second = [{"role": "user", "content": shared + "Question two: who wrote it?"}]
    third: Any = [{"role": "user", "content": shared + "Question three: why?"}]
    params = SamplingParams(max_tokens=1, temperature=0)
    ids = [llm.chat([m], params)[0].prompt_token_ids for m in (first, second, third)]
    expected = _whole_blocks_in_common(ids[1], ids[0])
    assert expected >= 4 * BLOCK_SIZE  # a prefix worth caching
    with live_server(tmp_path, model_folder=model_folder) as fresh:
        client = openai_client(fresh)
        answer = client.chat.completions.create(
            model=MODEL,
            messages=first,
            max_tokens=4,
            temperature=0,  # type: ignore[arg-type]
        )
        assert answer.usage is not None and answer.usage.prompt_tokens == len(ids[0])
        assert answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        again = client.chat.completions.create(
            model=MODEL,
            messages=second,
            max_tokens=4,
            temperature=0,  # type: ignore[arg-type]
        )
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == expected
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=second,  # type: ignore[arg-type]
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        # The whole of the second prompt but its last partial block is cached now.
        cached_all = (len(ids[1]) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert usage.prompt_tokens_details.cached_tokens == cached_all
        claude = anthropic_client(fresh)
        message = claude.messages.create(model=MODEL, max_tokens=4, messages=third)
        num_prompt = claude.messages.count_tokens(model=MODEL, messages=third).input_tokens
        assert num_prompt == len(ids[2])
        expected = max(
            _whole_blocks_in_common(ids[2], ids[0]), _whole_blocks_in_common(ids[2], ids[1])
        )
        usage_fields = {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}
        assert message.usage.model_dump(include=usage_fields) == {
            "input_tokens": num_prompt - expected,
            "cache_read_input_tokens": expected,
            "cache_creation_input_tokens": 0,
        }
        with claude.messages.stream(model=MODEL, max_tokens=4, messages=third) as stream:
            streamed = stream.get_final_message()
        cached_third = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert (streamed.usage.input_tokens, streamed.usage.cache_read_input_tokens) == (
            num_prompt - cached_third,
            cached_third,
        )


def _whole_blocks_in_common(prompt: list[int], cached: list[int]) -> int:
    """The tokens of `prompt` the prefix cache holds after `cached` ran: the whole blocks
    of their common prefix (a block is cached whole or not at all)."""
    common = next(i for i, (a, b) in enumerate(zip(prompt, cached, strict=False)) if a != b)
    return common // BLOCK_SIZE * BLOCK_SIZE
