"""Tool calling for both APIs in one text format: checks of the tools, their rendering
into the prompt, the grammar that holds calls to their schemas, and the output read back
(whole, or as it streams) as text and calls. Plain data in and out.

The format is the `<tools>` / `<tool_call>` convention small open models are tuned on
(Qwen2.5, Hermes). `render_system` appends the tools to the caller's system text (the
line after "</tools>" is one line, wrapped here):

    You are terse.

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": "get_weather", "parameters": {...}}}
    </tools>

    For each function call, return a json object with function name and arguments
    within <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

A call, in the output or in an earlier assistant turn, comes after any text, its JSON on
one line; calls are separated by "\\n". "name" comes first (the grammar says so): a
stream knows the tool before its arguments. A result goes back in a user turn (the chat
template has no tool role) as `<tool_response>\\n...\\n</tool_response>`.

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

from tokenfleet.core.sampling_params import JSON_OPTIONS, MAX_CONSTRAINT_SPEC_CHARS, Constraint
from tokenfleet.server.errors import APIError
from tokenfleet.server.structured import schema_problem

MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 16 * 1024  # one tool's input schema, as JSON
NAME_PATTERN = r"[a-zA-Z0-9_-]{1,64}"

ToolChoiceMode = Literal["auto", "required", "named", "none"]
TOOL_CHOICE_MODES: tuple[ToolChoiceMode, ...] = get_args(ToolChoiceMode)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HEAD_START, _HEAD_END = _OPEN + '\n{"name": "', '", "arguments": '  # around the name
_TAIL = "}\n" + _CLOSE  # after the arguments
_CALL_HEAD = re.compile(re.escape(_HEAD_START) + f"({NAME_PATTERN})" + re.escape(_HEAD_END))


def _prefix(text: str) -> str:  # a regex of the prefixes of `text`, "" included
    return "".join(f"(?:{re.escape(ch)}" for ch in text) + ")?" * len(text)


_HEAD_SO_FAR = re.compile(  # what a call's head may be while it streams in
    f"{_prefix(_HEAD_START)}|{re.escape(_HEAD_START)}[a-zA-Z0-9_-]{{0,64}}{_prefix(_HEAD_END)}"
)
_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _bad(message: str, param: str = "tool_choice") -> APIError:
    return APIError(400, "invalid_request", f"{param}: {message}", param=param)


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: `input_schema` None or {} means any object."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return self.input_schema or {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    """Whether the model must call: "auto" (text, calls, or text then calls), "required"
    (Anthropic's "any": calls only), "named" (calls of the tool `name` only), "none" (not
    held to anything). `parallel`: several calls allowed, else at most one."""

    mode: ToolChoiceMode = "auto"
    name: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in TOOL_CHOICE_MODES:
            raise _bad(f"must be one of {', '.join(TOOL_CHOICE_MODES)}, not {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise _bad("a tool's name is given with, and only with, a named tool")


class ToolCall(NamedTuple):
    name: str
    arguments: dict[str, Any]


class ParsedOutput(NamedTuple):
    """An output read back: its text before any call (less the whitespace before one), its
    complete calls, and whether it ends inside a call (cut off: the API reports length)."""

    text: str
    calls: list[ToolCall]
    cut_off: bool


def check_tools(tools: Sequence[Tool], choice: ToolChoice, param: str = "tools") -> None:
    """A 400 naming the tool (by index and name) whose name or schema cannot be served, or
    a tool_choice that names no tool of the list."""
    if len(tools) > MAX_TOOLS:
        raise _bad(f"{len(tools)} tools, over the limit of {MAX_TOOLS}", param)
    first: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"{param}.{i}"
        if not re.fullmatch(NAME_PATTERN, tool.name):
            raise _bad(f"the tool name {tool.name!r} does not match ^{NAME_PATTERN}$", where)
        if tool.name in first:
            raise _bad(f"the tool name {tool.name!r} is also {param}.{first[tool.name]}'s", where)
        first[tool.name] = i
        schema, its = tool.schema, f"tool {tool.name!r}: its input schema"
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise _bad(f"{its} must have type 'object'", where)
        spec = json.dumps(schema)
        if len(spec) > MAX_SCHEMA_CHARS:
            raise _bad(f"{its} is {len(spec)} characters as JSON, over {MAX_SCHEMA_CHARS}", where)
        if problem := schema_problem(json.dumps({**schema, "x-guidance": JSON_OPTIONS})):
            raise _bad(f"{its} is not supported: {problem}", where)
    if choice.mode in ("required", "named") and not tools:
        asked = repr(choice.mode) if choice.name is None else f"calling {choice.name!r}"
        raise _bad(f"{asked} needs at least one tool")
    if choice.name is not None and choice.name not in first:
        raise _bad(f"the tool {choice.name!r} is not among the request's tools")


def render_system(system: str, tools: Sequence[Tool]) -> str:
    """The system text: the caller's own (may be empty), then the tools and the format."""
    lines = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.schema
        lines.append(json.dumps({"type": "function", "function": function}, ensure_ascii=False))
    listed = _TOOLS_PROMPT.replace("{tools}", "\n".join(lines))
    return f"{system}\n\n{listed}" if system else listed


def render_call(name: str, arguments: dict[str, Any]) -> str:
    """One call as the model writes it (the module's docstring shows one)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{_OPEN}\n{call}\n{_CLOSE}"


def render_assistant(text: str, calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """An earlier assistant turn: its text, then its calls, one per line."""
    parts = [text] if text else []
    parts += [render_call(name, arguments) for name, arguments in calls]
    return "\n".join(parts)


def render_result(content: str) -> str:
    """A tool's result, for a user turn (several: joined by "\\n")."""
    return f"<tool_response>\n{content}\n</tool_response>"


def tool_constraint(tools: Sequence[Tool], choice: ToolChoice) -> Constraint | None:
    """The grammar the output must fit under `choice` (None for "none" or no tools: the
    output is free). Call check_tools first: this trusts names and schemas.

    "required"/"named": calls only; "auto": free text without "<tool_call>" in it, or
    such text then calls. A call is `<tool_call>\\n{"name": "X", "arguments": A}\\n</tool_call>`,
    one rule per tool, so that the name picks the schema A must fit."""
    if choice.mode == "none" or not tools:
        return None
    chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    more = ' ("\\n" call)*' if choice.parallel else ""
    lines = ["%llguidance {}"]
    if choice.mode == "auto":
        lines += [
            f"start: TEXT | HEAD call_body{more}",
            # Any text but "<tool_call>": that starts a call, whose form is then held.
            "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
            'HEAD: TEXT "<tool_call>"',
        ]
    else:
        lines.append(f"start: call{more}")
    if choice.mode != "auto" or choice.parallel:
        lines.append('call: "<tool_call>" call_body')
    lines.append('call_body: "\\n" body "\\n</tool_call>"')
    lines.append("body: " + " | ".join(f"tool_{i}" for i in range(len(chosen))))
    for i, tool in enumerate(chosen):
        head = json.dumps(f'{{"name": "{tool.name}", "arguments": ')
        lines.append(f'tool_{i}: {head} args_{i} "}}"')
        schema = {**tool.schema, "x-guidance": JSON_OPTIONS}
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
    spec = "\n".join(lines) + "\n"
    if len(spec) > MAX_CONSTRAINT_SPEC_CHARS:
        limit = MAX_CONSTRAINT_SPEC_CHARS
        raise _bad(f"the tools' grammar is {len(spec)} characters, over {limit}", "tools")
    return Constraint("grammar", spec)


def parse_output(text: str) -> ParsedOutput:
    """A whole output read back: its text before the calls, and the calls. Text after the
    last call (which the grammar does not allow) is dropped; a call that is incomplete or
    not in the format ends the reading, with `cut_off` set."""
    start = text.find(_OPEN)
    if start < 0:
        return ParsedOutput(text, [], False)
    before, rest, calls = text[:start].rstrip(), text[start:], list[ToolCall]()
    while True:
        head = _CALL_HEAD.match(rest)
        if head is None:
            return ParsedOutput(before, calls, True)
        try:
            arguments, end = json.JSONDecoder().raw_decode(rest, head.end())
        except json.JSONDecodeError:
            arguments, end = None, 0
        if not isinstance(arguments, dict) or not rest.startswith(_TAIL, end):
            return ParsedOutput(before, calls, True)
        calls.append(ToolCall(head[1], arguments))
        rest = rest[end + len(_TAIL) :].lstrip()
        if not rest.startswith(_OPEN):
            cut_off = bool(rest) and _OPEN.startswith(rest)  # "<tool_c" at the end
            return ParsedOutput(before, calls, cut_off)


@dataclass(frozen=True)
class PlainText:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:  # raw JSON text: a call's deltas join to its arguments' object
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int


ToolEvent = PlainText | CallStart | CallArguments | CallEnd
_State = Literal["text", "head", "arguments", "tail", "between", "done", "broken"]


class ToolStreamParser:
    """An output read as it streams, as events: the same text and calls parse_output reads
    from the whole, whatever the splits.

        text ──"<tool_call>"──▶ head ──name──▶ arguments ──}──▶ tail ──▶ between ──▶ head ...

    Text never carries markup: an end that may start "<tool_call>" (whitespace, then a
    prefix of it) is held back until the next delta tells."""

    def __init__(self) -> None:
        self._state: _State = "text"
        self._held = ""  # text not yet emitted, or markup not yet matched
        self._index = -1
        # The current call's arguments so far; their depth of objects and arrays; in a string?
        self._arguments, self._depth, self._in_string, self._escaped = "", 0, False, False

    def feed(self, delta: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        self._held += delta
        while self._step(events):
            pass
        return events

    def finish(self) -> tuple[list[ToolEvent], bool]:
        """(the events of what was held back, whether the output ends inside a call)."""
        held, self._held = self._held, ""
        if self._state == "text":
            return ([PlainText(held)] if held else []), False
        if self._state == "between":
            return [], bool(held.strip())  # "\n<tool_c": the next call was cut off
        return [], self._state != "done"

    def _step(self, events: list[ToolEvent]) -> bool:
        """Reads what it can of the held text: True if it moved on to another state."""
        held, state = self._held, self._state
        if state == "text":
            start = held.find(_OPEN)
            partial = next((k for k in range(len(_OPEN), 0, -1) if held.endswith(_OPEN[:k])), 0)
            text = held[: start if start >= 0 else len(held) - partial].rstrip()
            events += [PlainText(text)] if text else []
            if start >= 0:
                return self._go("head", held[start:])
            self._held = held[len(text) :]
            return False
        if state == "head":
            head = _CALL_HEAD.match(held)
            if head is None:
                return self._wait_if(_HEAD_SO_FAR.fullmatch(held) is not None)
            self._index += 1
            events.append(CallStart(self._index, head[1]))
            self._arguments, self._depth, self._in_string, self._escaped = "", 0, False, False
            return self._go("arguments", held[head.end() :])
        if state == "arguments":
            return self._read_arguments(events, held)
        if state == "tail":
            if not held.startswith(_TAIL):
                return self._wait_if(_TAIL.startswith(held))
            events.append(CallEnd(self._index))
            return self._go("between", held[len(_TAIL) :])
        if state == "between":
            rest = held.lstrip()
            if rest.startswith(_OPEN):
                return self._go("head", rest)
            if rest and not _OPEN.startswith(rest):
                return self._go("done", "")  # text after the calls: dropped
            return False
        self._held = ""  # done or broken: the rest is dropped
        return False

    def _read_arguments(self, events: list[ToolEvent], held: str) -> bool:
        end = None
        for j, ch in enumerate(held):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif self._depth == 0 and ch != "{":
                return self._go("broken", "")
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = j + 1
                    break
        piece = held if end is None else held[:end]
        if piece:
            self._arguments += piece
            events.append(CallArguments(self._index, piece))
        if end is None:
            self._held = ""
            return False
        try:
            complete = isinstance(json.loads(self._arguments), dict)
        except json.JSONDecodeError:
            complete = False
        return self._go("tail" if complete else "broken", held[end:])

    def _wait_if(self, may_fit: bool) -> bool:
        """Waits for more where what is held may still fit the markup, else breaks."""
        return False if may_fit else self._go("broken", "")

    def _go(self, state: _State, held: str) -> bool:
        self._state, self._held = state, held
        return True
