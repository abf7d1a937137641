"""A Messages request's content: its blocks (text; tool_use in assistant turns,
tool_result in user turns), its tools and tool_choice, read into the text the chat
template takes (tools.py's format) and the tools the output is held to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple, NoReturn

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenfleet.server.bounds import MAX_CONTENT_BLOCKS, MAX_TOOL_ID_CHARS
from tokenfleet.server.errors import APIError
from tokenfleet.server.structured import OutputConfig
from tokenfleet.server.tools import (
    Tool,
    ToolChoice,
    ToolChoiceMode,
    check_tools,
    render_assistant,
    render_result,
)
from tokenfleet.server.unsupported import text_blocks


# Strict: JSON types as they are, no coercion (max_tokens true or "10", stream "yes" are
# 400s, as on Anthropic's API, rather than 1, 10 and True). Optional fields sent as null
# read as absent (NULL_IS_DEFAULT); every number, count and length is bounded (bounds.py).
class TextBlock(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """A call an earlier assistant turn made."""

    model_config = ConfigDict(strict=True)

    type: Literal["tool_use"]
    id: str = Field(max_length=MAX_TOOL_ID_CHARS)
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A call's result, in a user turn."""

    model_config = ConfigDict(strict=True)

    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=MAX_TOOL_ID_CHARS)
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_BLOCKS)] = ""
    is_error: bool = False

    _text_only = field_validator("content", mode="before")(text_blocks)


Blocks = Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_BLOCKS)]
ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
MESSAGE_BLOCKS = ("text", "tool_use", "tool_result")


def _message_blocks(value: Any) -> Any:
    return text_blocks(value, MESSAGE_BLOCKS)


class MessageParam(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(max_length=MAX_CONTENT_BLOCKS)]

    _blocks = field_validator("content", mode="before")(_message_blocks)


class ToolParam(BaseModel):
    """A client tool (server tools, with another `type`, are not served)."""

    model_config = ConfigDict(strict=True)

    type: Literal["custom"] | None = None
    name: str
    description: str = ""
    input_schema: dict[str, Any]


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ToolUse(NamedTuple):
    tools: list[Tool]
    choice: ToolChoice


def text_of(content: str | Sequence[TextBlock | ToolUseBlock | ToolResultBlock]) -> str:
    """The text of a content value (its text blocks joined)."""
    if isinstance(content, str):
        return content
    return "".join(b.text for b in content if isinstance(b, TextBlock))


def turn_text(m: MessageParam) -> str:
    """A message as the chat template takes it: an assistant's text then its calls, a
    user's tool results then its text (tools.py's format)."""
    if isinstance(m.content, str):
        return m.content
    text = text_of(m.content)
    if m.role == "assistant":
        calls = [(b.name, b.input) for b in m.content if isinstance(b, ToolUseBlock)]
        return render_assistant(text, calls) if calls else text
    results = [
        render_result(text_of(b.content)) for b in m.content if isinstance(b, ToolResultBlock)
    ]
    return "\n".join([*results, text] if text else results)


def check_tool_blocks(messages: list[MessageParam]) -> None:
    """tool_use blocks in assistant turns only, tool_result blocks in user turns only, each
    result answering a call made before it."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        for j, b in enumerate(m.content if isinstance(m.content, list) else []):
            where = f"messages.{i}.content.{j}"
            if isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    _refuse(f"{where}: tool_use blocks belong in assistant messages", where)
                calls.add(b.id)
            elif isinstance(b, ToolResultBlock):
                if m.role != "user":
                    _refuse(f"{where}: tool_result blocks belong in user messages", where)
                if b.tool_use_id not in calls:
                    message = f"{where}: tool_result for {b.tool_use_id!r}, the id of no "
                    _refuse(message + "earlier tool_use block", where)


def _refuse(message: str, param: str) -> NoReturn:
    raise APIError(400, "invalid_request", message, param=param)


def tool_use(
    tool_params: list[ToolParam] | None,
    choice: ToolChoiceParam | None,
    output_config: OutputConfig | None,
) -> ToolUse | None:
    """The tools the output may call and how (None: no tools, or tool_choice none, under
    which they are neither listed to the model nor held to)."""
    if not tool_params or (choice is not None and choice.type == "none"):
        if choice is not None and choice.type in ("any", "tool"):
            _refuse(f"tool_choice: {choice.type!r} needs at least one tool", "tool_choice")
        return None
    tools = [Tool(t.name, t.description, t.input_schema) for t in tool_params]
    if choice is None or choice.type == "auto":
        mode: ToolChoiceMode = "auto"
    else:
        mode = "required" if choice.type == "any" else "named"
    parallel = choice is None or not choice.disable_parallel_tool_use
    name = choice.name if choice is not None and choice.type == "tool" else None
    if (choice is not None and choice.name is not None) and name is None:
        _refuse("tool_choice.name: a name goes with type 'tool' only", "tool_choice.name")
    if mode == "named" and name is None:
        _refuse("tool_choice.name: type 'tool' needs the tool's name", "tool_choice.name")
    tool_choice = ToolChoice(mode, name, parallel)
    check_tools(tools, tool_choice)
    if output_config is not None and output_config.format is not None:
        _refuse("output_config.format: not supported together with tools", "output_config.format")
    return ToolUse(tools, tool_choice)
