"""Tool calling's text format (server/tools.py): the prompt's exact text, the grammar of
each tool_choice mode compiled by llguidance against the bundled model's tokenizer (what
it accepts and refuses), the output read back whole and as a stream split anywhere, and
the 400s that name the tool and the feature."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.core.sampling_params import MAX_CONSTRAINT_SPEC_CHARS
from tokenfleet.server.errors import APIError
from tokenfleet.server.tools import (
    MAX_SCHEMA_CHARS,
    MAX_TOOLS,
    CallArguments,
    CallEnd,
    CallStart,
    ParsedOutput,
    PlainText,
    Tool,
    ToolCall,
    ToolChoice,
    ToolEvent,
    ToolStreamParser,
    check_tools,
    parse_output,
    render_assistant,
    render_call,
    render_result,
    render_system,
    tool_constraint,
)

WEATHER = Tool(
    "get_weather",
    "Current weather in a city.",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["C", "F"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
)
CLOCK = Tool("get_time")  # no description, no schema: any object
TOOLS = [WEATHER, CLOCK]

PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS_F = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "F"}}\n'
    "</tool_call>"
)
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
TIME_TZ = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(model_folder: Path) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(str(model_folder / "tokenizer.json"))


def test_the_system_prompt_lists_the_tools_after_the_callers_text() -> None:
    listed = (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Current '
        'weather in a city.", "parameters": {"type": "object", "properties": {"city": '
        '{"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}}, "required": '
        '["city"], "additionalProperties": false}}}\n'
        '{"type": "function", "function": {"name": "get_time", "parameters": {"type": '
        '"object"}}}\n'
        "</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )
    assert render_system("", TOOLS) == listed
    assert render_system("You are terse.", TOOLS) == "You are terse.\n\n" + listed


def test_earlier_calls_and_results_render_as_the_model_writes_them() -> None:
    assert render_call("get_weather", {"city": "Paris"}) == PARIS
    assert render_call("get_time", {}) == TIME
    assert render_call("say", {"text": "café"}) == (
        '<tool_call>\n{"name": "say", "arguments": {"text": "café"}}\n</tool_call>'
    )
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert render_assistant("Let me check.", calls) == f"Let me check.\n{PARIS}\n{TIME}"
    assert render_assistant("", calls[:1]) == PARIS
    assert render_assistant("No tools needed.", []) == "No tools needed."
    assert render_result('{"temp": 21}') == '<tool_response>\n{"temp": 21}\n</tool_response>'


class Grammar:
    """A tool_choice's grammar compiled against the bundled tokenizer."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, choice: ToolChoice) -> None:
        constraint = tool_constraint(TOOLS, choice)
        assert constraint is not None and constraint.kind == "grammar"
        self.spec = constraint.spec
        assert llguidance.LLMatcher.validate_grammar(self.spec, tokenizer) == ""
        self.tokenizer = tokenizer
        self.template = llguidance.LLMatcher(tokenizer, self.spec, log_level=0)
        assert not self.template.is_error(), self.template.get_error()

    def read(self, text: str) -> str:
        """ "complete" (it may end here), "stopped" (it must end here: nothing more fits),
        "incomplete" (it cannot end yet) or "refused"."""
        matcher = self.template.deep_copy()
        if not matcher.consume_tokens(self.tokenizer.tokenize_str(text)):
            return "refused"
        if matcher.is_stopped():
            return "stopped"
        return "complete" if matcher.is_accepting() else "incomplete"


def test_required_asks_for_calls_only_each_fitting_its_tools_schema(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    one = Grammar(tokenizer, ToolChoice("required", parallel=False))
    assert one.read(PARIS) == "stopped"  # one call: the request ends there
    assert one.read(PARIS_F) == "stopped"
    assert one.read(TIME_TZ) == "stopped"  # get_time takes any object
    assert one.read(PARIS[:40]) == "incomplete"
    refused = [
        "Sure, here is the weather.",
        "Let me check.\n" + PARIS,  # no text before the call
        PARIS + "\n" + TIME,  # one call at most
        PARIS.replace("get_weather", "get_news"),  # not a tool
        PARIS.replace('"Paris"', '"Paris", "tz": "UTC"'),  # get_weather has no tz
        PARIS.replace('"Paris"', '"Paris", "unit": "K"'),  # not in the enum
        PARIS.replace('"Paris"', '"' + "x" * 21 + '"'),  # over maxLength
        PARIS.replace('{"city": "Paris"}', '{"city":"Paris"}'),  # separators as written
        PARIS.replace('{"city": "Paris"}', '{ "city": "Paris" }'),
        '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
        PARIS.replace("\n", " "),
        PARIS + "\n",
    ]
    assert [one.read(text) for text in refused] == ["refused"] * len(refused)
    many = Grammar(tokenizer, ToolChoice("required", parallel=True))
    assert many.read(PARIS) == "complete"  # another call may follow
    assert many.read(f"{PARIS}\n{TIME}\n{PARIS_F}") == "complete"
    assert many.read(PARIS + "\n") == "incomplete"
    assert many.read(f"{PARIS}\n\n{TIME}") == "refused"
    assert many.read(f"{PARIS}{TIME}") == "refused"


def test_a_named_tool_choice_allows_that_tool_only(tokenizer: llguidance.LLTokenizer) -> None:
    named = Grammar(tokenizer, ToolChoice("named", "get_time", parallel=False))
    assert named.read(TIME_TZ) == "stopped"
    assert named.read(PARIS) == "refused"
    assert named.read("What time is it?") == "refused"
    assert '"name\\": \\"get_weather' not in named.spec


def test_auto_allows_text_or_calls_and_holds_a_started_call_to_its_schema(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    auto = Grammar(tokenizer, ToolChoice("auto", parallel=False))
    assert auto.read("It is sunny in Paris.") == "complete"
    assert auto.read("") == "complete"
    assert auto.read("a < b, and <tool> or <tool_c are text\n") == "complete"
    assert auto.read(PARIS) == "stopped"
    assert auto.read("Let me check.\n" + PARIS) == "stopped"
    assert auto.read("Let me check. <tool_call>") == "incomplete"
    refused = [
        "Let me check. <tool_call> the weather",  # "<tool_call>" in text starts a call
        "<tool_call>\n{}\n</tool_call>",
        PARIS.replace('"Paris"', "7"),
        PARIS + " Done.",  # nothing after the calls
        PARIS + "\n" + TIME,  # one call at most
    ]
    assert [auto.read(text) for text in refused] == ["refused"] * len(refused)
    many = Grammar(tokenizer, ToolChoice("auto", parallel=True))
    assert many.read(f"Checking both.\n{PARIS}\n{TIME_TZ}") == "complete"
    assert many.read(f"{PARIS}\nDone.") == "refused"


def test_none_or_no_tools_has_no_grammar() -> None:
    assert tool_constraint(TOOLS, ToolChoice("none")) is None
    assert tool_constraint([], ToolChoice("auto")) is None


def test_every_grammar_compiles_with_every_mode(tokenizer: llguidance.LLTokenizer) -> None:
    """And accepts each call as render_call writes it."""
    for mode in ("auto", "required"):
        for parallel in (False, True):
            grammar = Grammar(tokenizer, ToolChoice(mode, parallel=parallel))
            for name, arguments in [("get_weather", {"city": "Nice"}), ("get_time", {"a": [1]})]:
                assert grammar.read(render_call(name, arguments)) in ("stopped", "complete")


OUTPUTS: list[tuple[str, ParsedOutput]] = [
    ("", ParsedOutput("", [], False)),
    ("It is sunny. a < b <tool", ParsedOutput("It is sunny. a < b <tool", [], False)),
    ("Trailing space  \n", ParsedOutput("Trailing space  \n", [], False)),
    (PARIS, ParsedOutput("", [ToolCall("get_weather", {"city": "Paris"})], False)),
    (
        "Let me check both. \n" + PARIS_F + "\n" + TIME,
        ParsedOutput(
            "Let me check both.",
            [ToolCall("get_weather", {"city": "Paris", "unit": "F"}), ToolCall("get_time", {})],
            False,
        ),
    ),
    (
        # markup, braces, quotes and escapes inside the arguments' strings
        '<x>\n<tool_call>\n{"name": "get_time", "arguments": {"q": "<tool_call>}{\\"\\\\", '
        '"n": [{"a": null}, 1.5e3, true]}}\n</tool_call>',
        ParsedOutput(
            "<x>",
            [ToolCall("get_time", {"q": '<tool_call>}{"\\', "n": [{"a": None}, 1500.0, True]})],
            False,
        ),
    ),
    (PARIS + "\n<tool_c", ParsedOutput("", [ToolCall("get_weather", {"city": "Paris"})], True)),
    (PARIS + "\nDone.", ParsedOutput("", [ToolCall("get_weather", {"city": "Paris"})], False)),
    ("Hi <tool_call>\n{broken", ParsedOutput("Hi", [], True)),
    (PARIS_F.replace("unit", 'unit"'), ParsedOutput("", [], True)),
]


def test_parse_output_reads_text_and_calls() -> None:
    for text, parsed in OUTPUTS:
        assert parse_output(text) == parsed, text


def _stream(pieces: list[str]) -> tuple[list[ToolEvent], ParsedOutput]:
    """The events of a stream of these pieces, and what they add up to."""
    parser = ToolStreamParser()
    events = [event for piece in pieces for event in parser.feed(piece)]
    last, cut_off = parser.finish()
    events += last
    text, calls, current, arguments = "", list[ToolCall](), "", ""
    for event in events:
        if isinstance(event, PlainText):
            assert not calls and "<tool_call>" not in event.text and event.text
            text += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls)
            current, arguments = event.name, ""
        elif isinstance(event, CallArguments):
            assert event.index == len(calls) and event.text
            arguments += event.text
        elif isinstance(event, CallEnd):
            assert event.index == len(calls)
            calls.append(ToolCall(current, json.loads(arguments)))
    return events, ParsedOutput(text, calls, cut_off)


def test_the_stream_parser_emits_text_names_and_raw_arguments() -> None:
    events, _ = _stream(["Let me check. \n" + PARIS_F + "\n" + TIME])
    assert events == [
        PlainText("Let me check."),
        CallStart(0, "get_weather"),
        CallArguments(0, '{"city": "Paris", "unit": "F"}'),
        CallEnd(0),
        CallStart(1, "get_time"),
        CallArguments(1, "{}"),
        CallEnd(1),
    ]
    parser = ToolStreamParser()
    assert parser.feed("Hi <tool") == [PlainText("Hi")]  # " <tool" held back
    assert parser.feed("bar") == [PlainText(" <toolbar")]
    assert parser.feed(' <tool_call>\n{"name": "get_ti') == []
    assert parser.feed('me", "arguments": {"a"') == [
        CallStart(0, "get_time"),
        CallArguments(0, '{"a"'),
    ]
    assert parser.feed(": 1}}\n</tool_") == [CallArguments(0, ": 1}")]
    assert parser.feed("call>") == [CallEnd(0)]
    assert parser.finish() == ([], False)


def test_the_stream_split_per_character_or_in_two_reads_as_the_whole() -> None:
    for text, parsed in OUTPUTS:
        assert _stream(list(text))[1] == parsed, text
        for k in range(len(text) + 1):  # in two, at every point
            assert _stream([text[:k], text[k:]])[1] == parsed, (text, k)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(OUTPUTS), st.lists(st.integers(0, 200), max_size=12))
def test_the_stream_split_anywhere_reads_as_the_whole(
    output: tuple[str, ParsedOutput], cuts: list[int]
) -> None:
    text, parsed = output
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in pairwise(bounds)]
    assert _stream(pieces)[1] == parsed


def test_an_output_cut_off_inside_a_call_says_so() -> None:
    """Every prefix of text and two calls: cut off from "<tool_call>" on, but where a call
    has just ended; whole or streamed."""
    text = "Checking. " + PARIS + "\n" + TIME
    opened, first = len("Checking. <tool_call>"), len("Checking. " + PARIS)
    for k in range(len(text) + 1):
        parsed = parse_output(text[:k])
        # "Checking. <tool_c" is text; "...</tool_call>\n" is one call, "...\n<" is cut off
        assert parsed.cut_off == (k >= opened and k not in (first, first + 1, len(text))), k
        assert _stream(list(text[:k]))[1] == parsed
    assert parse_output(text[: len(text) - 1]).calls == [ToolCall("get_weather", {"city": "Paris"})]


def _refused(tools: list[Tool], choice: ToolChoice | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        check_tools(tools, choice or ToolChoice())
    assert info.value.status == 400 and info.value.kind == "invalid_request"
    return info.value


UNIQUE = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
LOOKAHEAD = {"type": "object", "properties": {"p": {"type": "string", "pattern": "(?=a)"}}}
BIG = {"type": "object", "description": "x" * MAX_SCHEMA_CHARS}  # 37 characters more


def test_tools_that_cannot_be_served_are_400s_naming_the_tool() -> None:
    check_tools(TOOLS, ToolChoice("named", "get_weather"))
    many = [Tool(f"t{i}") for i in range(MAX_TOOLS + 1)]
    cases: list[tuple[list[Tool], ToolChoice, str]] = [
        ([WEATHER, Tool("get time")], ToolChoice(), "tools.1: the tool name 'get time' does "
         "not match ^[a-zA-Z0-9_-]{1,64}$"),
        ([Tool("x" * 65)], ToolChoice(), f"tools.0: the tool name '{'x' * 65}' does not match"),
        ([WEATHER, CLOCK, WEATHER], ToolChoice(), "tools.2: the tool name 'get_weather' is "
         "also tools.0's"),
        ([Tool("t", "", {"type": "array"})], ToolChoice(), "tools.0: tool 't': its input "
         "schema must have type 'object'"),
        ([Tool("t", "", {"properties": {}})], ToolChoice(), "tools.0: tool 't': its input "
         "schema must have type 'object'"),
        ([CLOCK, Tool("tags", "", UNIQUE)], ToolChoice(), "tools.1: tool 'tags': its input "
         'schema is not supported: Unimplemented keys: ["uniqueItems"]'),
        ([Tool("re", "", LOOKAHEAD)], ToolChoice(), "tools.0: tool 're': its input schema is "
         "not supported: regex parse error:"),
        ([Tool("big", "", BIG)], ToolChoice(), f"tools.0: tool 'big': its input schema is "
         f"{MAX_SCHEMA_CHARS + 37} characters as JSON, over {MAX_SCHEMA_CHARS}"),
        (many, ToolChoice(), f"tools: {MAX_TOOLS + 1} tools, over the limit of {MAX_TOOLS}"),
        (TOOLS, ToolChoice("named", "get_news"), "tool_choice: the tool 'get_news' is not "
         "among the request's tools"),
        ([], ToolChoice("required"), "tool_choice: 'required' needs at least one tool"),
    ]  # fmt: skip
    for tools, choice, message in cases:
        error = _refused(tools, choice)
        assert error.message.startswith(message), error.message
        assert error.param == message.split(":")[0]
    assert "look-around" in _refused([Tool("re", "", LOOKAHEAD)]).message


def test_tool_choice_and_grammar_bounds_are_400s() -> None:
    with pytest.raises(APIError, match="tool_choice: a tool's name is given with") as info:
        ToolChoice("named")
    assert info.value.param == "tool_choice"
    with pytest.raises(APIError, match="tool_choice: must be one of auto, required"):
        ToolChoice("any")  # type: ignore[arg-type]
    schema: dict[str, Any] = {"type": "object", "description": "x" * (MAX_SCHEMA_CHARS - 100)}
    tools = [Tool(f"t{i}", "", schema) for i in range(9)]
    check_tools(tools, ToolChoice())  # each fits; together they are over the grammar's limit
    over = f"tools: the tools' grammar is .* over {MAX_CONSTRAINT_SPEC_CHARS}"
    with pytest.raises(APIError, match=over):
        tool_constraint(tools, ToolChoice())
    constraint = tool_constraint(tools, ToolChoice("named", "t3"))  # one of them fits
    assert constraint is not None and "t4" not in constraint.spec
