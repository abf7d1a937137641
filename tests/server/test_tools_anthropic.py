"""Tool use on the Anthropic Messages API, through the official client, on a real server
with the real model: `tools` rendered into the system text (tools.py's format, counted by
count_tokens), `tool_choice` any / tool / auto / none held by the grammar, `tool_use`
blocks with `toolu_` ids and `stop_reason: "tool_use"`, `tool_result` turns after them;
streamed as content_block_start / input_json_delta / content_block_stop, which the
client's accumulator rebuilds into the non-streamed message; a call cut off by max_tokens
reported as max_tokens; 400s that name the tool or block.

The bundled 135M model was not tuned on tool calls: it calls only when it must (`any`,
`tool`), which is what the tests ask of it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server
from support.tools import anthropic_tool

from tokenfleet import LLM, SamplingParams
from tokenfleet.server.tools import Tool, ToolChoice, render_system, tool_constraint

pytestmark = pytest.mark.slow

WEATHER: Any = anthropic_tool("get_weather")
TIME: Any = anthropic_tool("get_time")
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 60
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("tools-anthropic"), model_folder=model_folder) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
    )


def without_ids(message: anthropic.types.Message) -> list[dict[str, Any]]:
    """The content blocks, tool_use ids left out (each answer draws its own)."""
    blocks = [b.model_dump(exclude_none=True) for b in message.content]
    for block in blocks:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    return blocks


def test_a_required_call_streamed_and_not_then_its_result(
    client: anthropic.Anthropic, model_folder: Path
) -> None:
    """tool_choice any: one tool_use block (the tool, an input that fits its schema),
    stop_reason tool_use, the in-process engine's greedy call under the same grammar;
    streamed, the client's accumulator rebuilds the same message; the raw events open the
    block with an empty input and its input_json_delta fragments join to the input; the
    next turn with the tool_result is answered in text."""
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": ASK}
    # One call: with parallel calls the model goes on calling until max_tokens.
    choice = {"type": "any", "disable_parallel_tool_use": True}
    kwargs |= {"tools": [WEATHER], "tool_choice": choice, "extra_body": GREEDY}
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use", message
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert set(block.input) == {"city"} and isinstance(block.input["city"], str)
    # The engine's own greedy output under the grammar, as text: the call in tools.py's form.
    llm = LLM(str(model_folder), kv_cache_memory=64 << 20, num_threads=1)
    tools = [Tool(WEATHER["name"], WEATHER["description"], WEATHER["input_schema"])]
    constraint = tool_constraint(tools, ToolChoice("required", parallel=False))
    system = {"role": "system", "content": render_system("", tools)}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, constraint=constraint)
    expected = llm.chat([[system, *ASK]], params)[0].text
    call = json.dumps({"name": "get_weather", "arguments": block.input})
    assert expected == f"<tool_call>\n{call}\n</tool_call>"

    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert without_ids(streamed) == without_ids(message)
    assert streamed.stop_reason == "tool_use"
    (start,) = [e.content_block for e in events if e.type == "content_block_start"]
    assert start.type == "tool_use" and start.id.startswith("toolu_")
    assert (start.name, start.input) == ("get_weather", {})
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == block.input
    assert not any(e.type == "content_block_delta" and e.delta.type == "text_delta" for e in events)

    follow_up = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 21 C"}],
        },
    ]
    answer = client.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, messages=follow_up, tools=[WEATHER], extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
    assert "<tool_call>" not in answer.content[0].text  # type: ignore[union-attr]


def test_a_named_tool_and_no_parallel_calls(client: anthropic.Anthropic) -> None:
    """tool_choice tool (get_time) among two tools, parallel calls off: exactly one call,
    of that tool, with an input from its enum."""
    message = client.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": "What time is it in Berlin?"}],
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_time"
    assert block.input in ({"zone": "UTC"}, {"zone": "CET"}, {"zone": "PST"})


def test_a_call_cut_off_by_max_tokens_is_max_tokens_not_a_tool_use(
    client: anthropic.Anthropic,
) -> None:
    """max_tokens 5 ends inside the call: stop_reason max_tokens and no tool_use block,
    whole; streamed, stop_reason max_tokens too."""
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "messages": ASK}
    kwargs |= {"tools": [WEATHER], "tool_choice": {"type": "any"}, "extra_body": GREEDY}
    message = client.messages.create(**kwargs)
    assert (message.stop_reason, message.content) == ("max_tokens", [])
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens"


def test_count_tokens_counts_the_tools_as_rendered(
    client: anthropic.Anthropic, model_folder: Path
) -> None:
    """count_tokens with tools: the prompt with the tools in its system text, exactly the
    length of the engine's rendering of it; tool_choice none leaves them out."""
    llm = LLM(str(model_folder), kv_cache_memory=64 << 20, num_threads=1)
    tools = [Tool(t["name"], t["description"], t["input_schema"]) for t in (WEATHER, TIME)]  # type: ignore[arg-type]
    system = {"role": "system", "content": render_system("Be brief.", tools)}
    params = SamplingParams(max_tokens=1, temperature=0)
    expected = len(llm.chat([[system, *ASK]], params)[0].prompt_token_ids)
    counted = client.messages.count_tokens(
        model=MODEL,
        system="Be brief.",
        messages=ASK,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
    )
    assert counted.input_tokens == expected
    plain = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK)
    none = client.messages.count_tokens(
        model=MODEL,
        system="Be brief.",
        messages=ASK,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "none"},
    )
    assert none.input_tokens == plain.input_tokens < expected


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"tools": [{**WEATHER, "name": "get weather"}]},
            "tools.0",
            "'get weather' does not match",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools.1", "is also tools.0's"),
        (
            {
                "tools": [
                    {
                        **WEATHER,
                        "input_schema": {
                            "type": "object",
                            "properties": {"t": {"type": "array", "uniqueItems": True}},
                        },
                    }
                ]
            },
            "tools.0",
            "tool 'get_weather': its input schema is not supported: Unimplemented keys: "
            '["uniqueItems"]',
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
            "tool_choice",
            "'nope' is not among",
        ),
        (
            {
                "tools": [WEATHER],
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
            },
            "output_config.format",
            "not supported together with tools",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}
                        ],
                    }
                ]
            },
            "messages.0.content.0",
            "the id of no earlier tool_use block",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}
                        ],
                    }
                ]
            },
            "messages.0.content.0",
            "tool_use blocks belong in assistant messages",
        ),
    ],
)
def test_bad_tools_and_blocks_are_400s_naming_them(
    server: LiveServer, fields: dict[str, Any], param: str, words: str
) -> None:
    import httpx

    body = {"model": MODEL, "max_tokens": 10, "messages": ASK} | fields
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        reply = httpx.post(f"{server.url}{route}", json=body, timeout=HTTP_TIMEOUT_S)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{param}: ") and words in error["message"], error
