"""Tool calling on OpenAI Chat Completions: the request's `tools`, `tool_choice` and
`parallel_tool_calls`; earlier calls and their results in `messages`; each choice's output
read back into `message.tool_calls` (whole) or `delta.tool_calls` (streamed). The text
format, the grammars and the output readers are tools.py's, shared with Anthropic's API.

    request   tools: [{"type": "function", "function": {"name", "description", "parameters"}}]
              tool_choice: "none" | "auto" | "required" | {"type": "function",
                           "function": {"name"}}             (default "auto" with tools)
    messages  {"role": "assistant", "content": null, "tool_calls": [{"id", "type":
              "function", "function": {"name", "arguments": "<JSON text>"}}]}
              {"role": "tool", "tool_call_id", "content"}    (a user turn; several in a
                                                              row: one turn)
    reply     message: {"content": null (or the text before the calls), "tool_calls":
              [{"id": "call_<24 hex>", "type": "function", "function": {"name",
              "arguments": the model's own JSON text}}]}, finish_reason "tool_calls"; a
              call cut off (by max_tokens, a stop) is not reported: finish_reason "length"
    stream    delta {"role": "assistant", "content": null}, then per call
              {"tool_calls": [{"index": k, "id", "type": "function", "function": {"name",
              "arguments": ""}}]} and {"tool_calls": [{"index": k, "function":
              {"arguments": "<fragment>"}}]}...; a cut-off call's start has gone out by then

tool_choice "none" renders no tools and holds the output to nothing: shown the tools, a
small model writes call markup that nothing would then read back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field

from tokenfleet.core.sampling_params import Constraint
from tokenfleet.server.bounds import MAX_CONTENT_BLOCKS, MAX_TOOL_ID_CHARS
from tokenfleet.server.errors import APIError
from tokenfleet.server.ids import random_hex
from tokenfleet.server.tools import (
    CallArguments,
    CallEnd,
    CallStart,
    PlainText,
    Tool,
    ToolChoice,
    ToolEvent,
    ToolStreamParser,
    check_tools,
    render_assistant,
    render_result,
    render_system,
    tool_constraint,
)

if TYPE_CHECKING:
    from tokenfleet.server.openai_api import ChatMessage, ChatRequest

# OpenAI: "Omitting parameters defines a function with an empty parameter list."
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDefinition(BaseModel):
    name: str  # checked by tools.check_tools, whose 400 names the tool's index
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar holds every call to its schema: always strict


class FunctionTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallParam(BaseModel):
    """A call in an earlier assistant turn."""

    id: str = Field(max_length=MAX_TOOL_ID_CHARS)
    type: Literal["function"]
    function: CalledFunction


ToolCallParams = Annotated[list[ToolCallParam], Field(max_length=MAX_CONTENT_BLOCKS)]
ToolChoiceParam = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ChatTools:
    """A request's tools and how the model may call them."""

    tools: list[Tool]
    choice: ToolChoice

    @property
    def active(self) -> bool:
        """Whether the tools are rendered, the output held to the grammar and read back."""
        return bool(self.tools) and self.choice.mode != "none"

    def constraint(self) -> Constraint | None:
        return tool_constraint(self.tools, self.choice) if self.active else None


def chat_tools(body: ChatRequest) -> ChatTools:
    """The request's tools, checked: a 400 names the tool, or the tool_choice, at fault."""
    tools = [
        Tool(
            t.function.name,
            t.function.description or "",
            NO_PARAMETERS if t.function.parameters is None else t.function.parameters,
        )
        for t in body.tools or []
    ]
    parallel = body.parallel_tool_calls
    if isinstance(body.tool_choice, NamedToolChoice):
        choice = ToolChoice("named", body.tool_choice.function.name, parallel)
    else:
        choice = ToolChoice(body.tool_choice or ("auto" if tools else "none"), None, parallel)
    check_tools(tools, choice, "tools")
    result = ChatTools(tools, choice)
    kind = body.response_format.type if body.response_format else "text"
    if result.active and kind != "text":
        message = (
            f"response_format: {kind!r} together with tools is not supported (unless "
            "tool_choice is 'none': the tools are then left unused)"
        )
        raise APIError(400, "invalid_request", message, param="response_format")
    return result


def content_text(message: ChatMessage) -> str:
    content = message.content
    return content if isinstance(content, str) else "".join(p.text for p in content or [])


def chat_messages(messages: Sequence[ChatMessage], tools: ChatTools) -> list[dict[str, str]]:
    """The conversation as the chat template takes it: earlier calls rendered into their
    assistant turns, results (consecutive ones joined) into user turns, and the tools into
    the system text (the caller's, if the conversation opens with one)."""
    turns: list[dict[str, str]] = []
    results = False  # whether the last turn holds tool results
    for i, m in enumerate(messages):
        text = content_text(m)
        if m.role == "tool":
            if m.tool_call_id is None:
                param = f"messages.{i}.tool_call_id"
                message = f"{param}: a tool message needs the id of the call it answers"
                raise APIError(400, "invalid_request", message, param=param)
            if results:
                turns[-1]["content"] += "\n" + render_result(text)
            else:
                turns.append({"role": "user", "content": render_result(text)})
            results = True
            continue
        results = False
        if m.role == "assistant" and m.tool_calls:
            calls = [
                (c.function.name, _arguments(c, f"messages.{i}.tool_calls.{k}.function.arguments"))
                for k, c in enumerate(m.tool_calls)
            ]
            turns.append({"role": "assistant", "content": render_assistant(text, calls)})
        else:
            turns.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    if tools.active:
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = render_system(turns[0]["content"], tools.tools)
        else:
            turns.insert(0, {"role": "system", "content": render_system("", tools.tools)})
    return turns


def _arguments(call: ToolCallParam, param: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        arguments, problem = None, f"not JSON ({exc})"
    else:
        problem = f"a JSON {type(arguments).__name__}, not an object"
    if not isinstance(arguments, dict):
        message = f"{param}: the arguments must be a JSON object, and are {problem}"
        raise APIError(400, "invalid_request", message, param=param)
    return arguments


def finish_reason(engine_reason: str, num_calls: int, cut_off: bool) -> str:
    """A choice's finish_reason: "length" for an output cut off (by max_tokens, or inside
    a call: that call is not reported), else "tool_calls" for one with calls."""
    if engine_reason == "length" or cut_off:
        return "length"
    return "tool_calls" if num_calls else engine_reason


class ToolDeltas:
    """One choice's output read as it streams, into OpenAI deltas: text is `content`, a
    call's start its own delta (id, type, name, arguments ""), its arguments' text deltas
    of `function.arguments` alone. No markup reaches `content`."""

    def __init__(self) -> None:
        self._parser = ToolStreamParser()
        self.content = ""  # what the content deltas add up to
        self.calls: list[dict[str, Any]] = []  # the complete calls, as message.tool_calls
        self._started: dict[str, Any] | None = None  # the call being read

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self._parser.feed(text))

    def finish(self, engine_reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the choice's finish_reason."""
        events, cut_off = self._parser.finish()
        deltas = self._deltas(events)
        if not self.content and not self.calls:
            deltas.append({"content": ""})  # the whole message's content is "", not null
        return deltas, finish_reason(engine_reason, len(self.calls), cut_off)

    def message(self) -> dict[str, Any]:
        """The whole message, once finished: content null when it is empty and there are
        calls; no `tool_calls` when there are none."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content or (None if self.calls else ""),
            "refusal": None,
        }
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    def _deltas(self, events: list[ToolEvent]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        current: dict[str, Any] = {}
        for event in events:
            if isinstance(event, PlainText):
                current["content"] = current.get("content", "") + event.text
                self.content += event.text
            elif isinstance(event, CallStart):
                if current:
                    deltas.append(current)
                    current = {}
                function = {"name": event.name, "arguments": ""}
                self._started = {"id": "call_" + random_hex(24), "type": "function"}
                start = {"index": event.index, **self._started, "function": dict(function)}
                deltas.append({"tool_calls": [start]})
                self._started["function"] = function  # its arguments grow as they come
            elif isinstance(event, CallArguments):
                assert self._started is not None
                self._started["function"]["arguments"] += event.text
                entries = current.setdefault(
                    "tool_calls", [{"index": event.index, "function": {"arguments": ""}}]
                )
                entries[0]["function"]["arguments"] += event.text
            elif isinstance(event, CallEnd):
                assert self._started is not None
                self.calls.append(self._started)
                self._started = None
        if current:
            deltas.append(current)
        return deltas
