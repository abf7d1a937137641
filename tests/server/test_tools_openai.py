"""Tool calling on OpenAI Chat Completions, through the official client, on a real server
with the real model: `tools` rendered into the system text (tools.py's format),
`tool_choice` required / named / auto / none held by the grammar, `message.tool_calls`
with `call_` ids and finish_reason "tool_calls", assistant tool_calls and `tool` results
in later turns; streamed as `delta.tool_calls`, which the client's accumulator rebuilds
into the non-streamed message; a call cut off by max_tokens reported as "length"; 400s
naming the tool or the field; the Batch API answering as the sync API.

Each answer is also the in-process engine's greedy answer on the conversation rendered as
tools.py renders it, under the same grammar: the API renders and constrains exactly that.
The bundled 135M model was not tuned on tool calls: it calls only when it must.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server
from support.tools import openai_batch_results, openai_tool

from tokenfleet import LLM, SamplingParams
from tokenfleet.server.tools import (
    Tool,
    ToolChoice,
    render_assistant,
    render_result,
    render_system,
    tool_constraint,
)

pytestmark = pytest.mark.slow

WEATHER: Any = openai_tool("get_weather")
TIME: Any = openai_tool("get_time")
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 60
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def as_tool(tool: dict[str, Any]) -> Tool:
    f = tool["function"]
    return Tool(f["name"], f["description"], f["parameters"])


@pytest.fixture(scope="module")
def server(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("tools-openai"), model_folder=model_folder) as s:
        yield s


@pytest.fixture(scope="module")
def llm(model_folder: Path) -> LLM:
    """The in-process engine, one thread as the server's."""
    return LLM(str(model_folder), kv_cache_memory=64 << 20, num_threads=1)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
    )


def engine_answer(
    llm: LLM,
    messages: list[dict[str, str]],
    tools: list[dict[str, Any]],
    choice: ToolChoice,
    max_tokens: int = MAX_TOKENS,
) -> tuple[str, list[int]]:
    """The engine's greedy text and token ids on `messages` (already rendered)."""
    constraint = tool_constraint([as_tool(t) for t in tools], choice)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, constraint=constraint)
    output = llm.chat([messages], params)[0]
    return output.text, output.token_ids


def with_tools(messages: list[dict[str, str]], tools: list[dict[str, Any]]) -> list[Any]:
    """`messages` with the tools' system text first (the caller's system text merged)."""
    rendered = [as_tool(t) for t in tools]
    if messages[0]["role"] == "system":
        return [
            {**messages[0], "content": render_system(messages[0]["content"], rendered)},
            *messages[1:],
        ]
    return [{"role": "system", "content": render_system("", rendered)}, *messages]


def call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def same_choices(a: Any, b: Any) -> None:
    """Two completions' choices alike in all but the calls' random ids."""
    assert len(a.choices) == len(b.choices)
    for x, y in zip(a.choices, b.choices, strict=True):
        assert (x.index, x.finish_reason) == (y.index, y.finish_reason)
        assert x.message.content == y.message.content
        assert (x.message.tool_calls is None) == (y.message.tool_calls is None)
        calls = [x.message.tool_calls or [], y.message.tool_calls or []]
        assert [(c.type, c.function.name, c.function.arguments) for c in calls[0]] == [
            (c.type, c.function.name, c.function.arguments) for c in calls[1]
        ]
        assert all(CALL_ID.fullmatch(c.id) for c in calls[0] + calls[1])


def final_of_stream(client: openai.OpenAI, **kwargs: Any) -> Any:
    """`chat.completions.stream(...)`'s final completion (which the client raises a
    LengthFinishReasonError over, completion attached, when a choice ran out of tokens)."""
    try:
        with client.chat.completions.stream(**kwargs) as stream:
            return stream.get_final_completion()
    except openai.LengthFinishReasonError as exc:
        return exc.completion


def raw_chunks(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    return list(client.chat.completions.create(stream=True, **kwargs))


def streamed_calls(chunks: list[Any], index: int = 0) -> list[dict[str, Any]]:
    """A choice's calls as its raw deltas give them, checking their shape: a call's first
    delta has its id, type and name and arguments ""; the later ones its arguments alone."""
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        for choice in chunk.choices:
            assert "<tool_call>" not in (choice.delta.content or "")
            if choice.index != index:
                continue
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index == len(calls) and CALL_ID.fullmatch(delta.id)
                    assert delta.type == "function" and delta.function.arguments == ""
                    calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                else:
                    assert delta.index == len(calls) - 1 and delta.type is None
                    assert delta.function.name is None and delta.function.arguments
                    calls[-1]["arguments"] += delta.function.arguments
    return calls


def finish_reasons(chunks: list[Any]) -> dict[int, str]:
    return {c.index: c.finish_reason for k in chunks for c in k.choices if c.finish_reason}


# -- calls ----------------------------------------------------------------------------------------


def test_a_required_call_streamed_and_not_is_the_engines_call(
    client: openai.OpenAI, llm: LLM
) -> None:
    """tool_choice "required", one call at most: one get_weather call whose arguments are
    the engine's greedy text under the grammar, verbatim; content None, finish
    "tool_calls"; the stream's accumulated completion is the same, and its raw deltas
    carry no markup and join to the same arguments."""
    kwargs: Any = {"model": MODEL, "messages": ASK, "max_tokens": MAX_TOKENS, "temperature": 0}
    kwargs |= {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    completion = client.chat.completions.create(**kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and CALL_ID.fullmatch(call.id)
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
    text, token_ids = engine_answer(
        llm, with_tools(ASK, [WEATHER]), [WEATHER], ToolChoice("required", parallel=False)
    )
    assert text == call_text("get_weather", call.function.arguments)
    assert completion.usage is not None and completion.usage.completion_tokens == len(token_ids)

    same_choices(final_of_stream(client, **kwargs), completion)
    chunks = raw_chunks(client, **kwargs)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content is None
    calls = streamed_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert finish_reasons(chunks) == {0: "tool_calls"}


def test_a_named_tool_choice_calls_that_tool(client: openai.OpenAI, llm: LLM) -> None:
    """tool_choice naming get_time among two tools, parallel_tool_calls false: exactly one
    call, of get_time, its zone one of the enum's; the engine's greedy answer."""
    tools = [WEATHER, TIME]
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=MAX_TOKENS,
        temperature=0,
        tools=tools,
        tool_choice=named,
        parallel_tool_calls=False,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET", "PST")
    text, _ = engine_answer(
        llm, with_tools(ASK, tools), tools, ToolChoice("named", "get_time", parallel=False)
    )
    assert text == call_text("get_time", call.function.arguments)


def test_each_of_n_sampled_choices_is_read_separately_with_its_logprobs(
    client: openai.OpenAI,
) -> None:
    """n=2 sampled with a seed, logprobs on: streamed and not, the same choices (each its
    own calls and finish_reason), and the same tokens' logprobs, one per output token."""
    kwargs: Any = {"model": MODEL, "messages": ASK, "max_tokens": MAX_TOKENS, "n": 2}
    kwargs |= {"temperature": 1.0, "seed": 11, "logprobs": True, "top_logprobs": 2}
    kwargs |= {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    completion = client.chat.completions.create(**kwargs)
    assert [c.finish_reason for c in completion.choices] == ["tool_calls"] * 2
    for choice in completion.choices:
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    chunks = raw_chunks(client, **kwargs)
    assert finish_reasons(chunks) == {0: "tool_calls", 1: "tool_calls"}
    for choice in completion.choices:
        assert choice.message.tool_calls is not None and choice.logprobs is not None
        calls = streamed_calls(chunks, choice.index)
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (t.function.name, t.function.arguments) for t in choice.message.tool_calls
        ]
        streamed = [
            (lp.token, lp.logprob)
            for k in chunks
            for c in k.choices
            if c.index == choice.index and c.logprobs is not None
            for lp in c.logprobs.content or []
        ]
        whole = [(lp.token, lp.logprob) for lp in choice.logprobs.content or []]
        assert [t for t, _ in streamed] == [t for t, _ in whole]
        # The same tokens' logprobs, to the last float bits only where the two requests'
        # rows ran in alike batches: a row's numbers depend on the batch it runs in (the
        # choices admitted in one step or two, a prompt whole or from the prefix cache),
        # and that depends on timing (under load: -3.4732485 against -3.4732614).
        assert [p for _, p in streamed] == pytest.approx([p for _, p in whole], abs=1e-4)
    total = sum(len(c.logprobs.content or []) for c in completion.choices if c.logprobs)
    assert completion.usage is not None and total == completion.usage.completion_tokens
    same_choices(final_of_stream(client, **kwargs), completion)


def test_a_call_cut_off_by_max_tokens_is_length_and_not_reported(
    client: openai.OpenAI, llm: LLM
) -> None:
    """max_tokens ending the output inside a call's markup: finish "length", no tool_calls,
    content "" (the text before the call), streamed and not. Cut inside the call's
    arguments: the same reply, and the stream has already sent the call's start and the
    arguments so far (which its finish_reason "length" tells are incomplete)."""
    kwargs: Any = {"model": MODEL, "messages": ASK, "temperature": 0, "tools": [WEATHER]}
    kwargs |= {"tool_choice": "required", "parallel_tool_calls": False}
    completion = client.chat.completions.create(max_tokens=5, **kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None and choice.message.content == ""
    same_choices(final_of_stream(client, max_tokens=5, **kwargs), completion)
    # Where the arguments have begun: the text the engine wrote so far.
    required = ToolChoice("required", parallel=False)
    _, token_ids = engine_answer(llm, with_tools(ASK, [WEATHER]), [WEATHER], required)
    decode = llm.tokenizer.decode
    cut = next(k for k in range(len(token_ids)) if '"arguments": {"' in decode(token_ids[:k]))
    chunks = raw_chunks(client, max_tokens=cut, **kwargs)
    assert finish_reasons(chunks) == {0: "length"}
    so_far = decode(token_ids[:cut]).split('"arguments": ', 1)[1]
    assert [(c["name"], c["arguments"]) for c in streamed_calls(chunks)] == [
        ("get_weather", so_far)
    ]
    completion = client.chat.completions.create(max_tokens=cut, **kwargs)
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.tool_calls is None


# -- later turns --------------------------------------------------------------------------------

EARLIER_CALLS: Any = [
    {
        "id": "call_weather",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {"id": "call_time", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
CONVERSATION: Any = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": EARLIER_CALLS},
    {"role": "tool", "tool_call_id": "call_weather", "content": "Sunny, 24 C"},
    {"role": "tool", "tool_call_id": "call_time", "content": [{"type": "text", "text": "14:05"}]},
]
RENDERED = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris, and the time?"},
    {
        "role": "assistant",
        "content": render_assistant("", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    },
    {"role": "user", "content": render_result("Sunny, 24 C") + "\n" + render_result("14:05")},
]


@pytest.mark.parametrize("tool_choice", ["auto", "none", None])
def test_calls_and_results_in_the_history_render_as_the_format(
    client: openai.OpenAI, llm: LLM, tool_choice: str | None
) -> None:
    """An assistant turn's tool_calls and the tool results after it (two results: one user
    turn): the answer is the engine's greedy answer on the rendered conversation, the
    tools in the caller's system text under "auto", left out under "none" (and with no
    tools sent); a text answer, no calls; streamed the same."""
    kwargs: Any = {"model": MODEL, "messages": CONVERSATION, "max_tokens": MAX_TOKENS}
    kwargs["temperature"] = 0
    if tool_choice is not None:
        kwargs |= {"tools": [WEATHER, TIME], "tool_choice": tool_choice}
    completion = client.chat.completions.create(**kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    if tool_choice == "auto":
        expected = engine_answer(
            llm, with_tools(RENDERED, [WEATHER, TIME]), [WEATHER, TIME], ToolChoice()
        )
    else:
        expected = engine_answer(llm, RENDERED, [], ToolChoice("none"))
    assert choice.message.content == expected[0]
    same_choices(final_of_stream(client, **kwargs), completion)


# -- refusals -----------------------------------------------------------------------------------

UNIQUE_TAGS: Any = {
    "type": "function",
    "function": {
        "name": "tag",
        "parameters": {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
            },
        },
    },
}


def _named(name: str) -> Any:
    return {"type": "function", "function": {"name": name}}


def _history(arguments: str) -> Any:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]


REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": [_named("get weather")]}, "tools.0", "the tool name 'get weather' does not match"),
    ({"tools": [WEATHER, TIME, WEATHER]}, "tools.2", "is also tools.0's"),
    ({"tools": [UNIQUE_TAGS]}, "tools.0", "tool 'tag': its input schema is not supported"),
    ({"tools": [WEATHER], "tool_choice": _named("get_time")}, "tool_choice", "'get_time' is not"),
    ({"tool_choice": "required"}, "tool_choice", "'required' needs at least one tool"),
    (
        {"tools": [WEATHER], "response_format": {"type": "json_object"}},
        "response_format",
        "'json_object' together with tools is not supported",
    ),
    ({"messages": _history("{city")}, "messages.1.tool_calls.0.function.arguments", "not JSON"),
    ({"messages": _history("[1]")}, "messages.1.tool_calls.0.function.arguments", "a JSON list"),
    (
        {"messages": [*ASK, {"role": "tool", "content": "ok"}]},
        "messages.1.tool_call_id",
        "a tool message needs the id",
    ),
]


@pytest.mark.parametrize(("fields", "param", "says"), REFUSED)
def test_tools_that_cannot_be_served_are_400s_naming_them(
    server: LiveServer, client: openai.OpenAI, fields: dict[str, Any], param: str, says: str
) -> None:
    """A bad tool name, a name twice, a schema feature the grammar library lacks
    (uniqueItems), a tool_choice naming no tool (or "required" with none), response_format
    with tools, arguments in the history that are not a JSON object, a tool result with no
    call id: a 400 in OpenAI's error shape naming the field, from the client as from HTTP."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, **fields}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(reply.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(f"{param}: ") and says in error["message"], error
    if fields.get("tools") == [UNIQUE_TAGS]:
        assert 'Unimplemented keys: ["uniqueItems"]' in error["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**body)
    assert refused.value.param == param and refused.value.body == error


# -- the Batch API -------------------------------------------------------------------------------

CITIES = ["Paris", "Tokyo", "Lima"]


def test_a_batch_of_tool_calls_answers_as_the_sync_api(client: openai.OpenAI) -> None:
    """Three batch requests with tools, tool_choice "required": each result's choice is the
    sync API's (calls, arguments, content, finish_reason), with ids of its own."""
    bodies = [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"What is the weather in {city}?"}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "tools": [WEATHER, TIME],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
        for city in CITIES
    ]
    results = openai_batch_results(client, dict(zip(CITIES, bodies, strict=True)), 300)
    for city, body in zip(CITIES, bodies, strict=True):
        assert results[city]["response"]["status_code"] == 200
        batched = openai.types.chat.ChatCompletion.model_validate(results[city]["response"]["body"])
        assert batched.choices[0].finish_reason == "tool_calls"
        same_choices(batched, client.chat.completions.create(**body))
