"""What a Message answers, whole or as events: its content blocks (text, and with tools
the `tool_use` blocks read back from the output), its stop reason and its usage.

A streamed Message with tools opens its blocks as the output goes: text in a text block,
each call in a tool_use block (`{"type": "tool_use", "id", "name", "input": {}}`) whose
`input_json_delta` fragments join to the call's input, as the SDKs' accumulators read
them. The call's markup never reaches a text delta. A call cut off by max_tokens (or a
stop sequence) is never a tool use: the stop reason is the cut's, and the whole answer
leaves the call out (a stream has shown its start by then: its block is closed as it is).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from tokenfleet.server.errors import APIError, anthropic_error_body
from tokenfleet.server.ids import random_hex
from tokenfleet.server.service import TextDelta
from tokenfleet.server.sse import sse_event
from tokenfleet.server.tools import (
    CallArguments,
    CallStart,
    PlainText,
    ToolEvent,
    ToolStreamParser,
    parse_output,
)

logger = logging.getLogger(__name__)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


def tool_use_id() -> str:
    return f"toolu_{random_hex(24)}"


def usage(num_prompt: int, delta: TextDelta) -> dict[str, int]:
    """Usage as Anthropic defines it: `input_tokens` are the prompt tokens not read from
    the prefix cache, `cache_read_input_tokens` those that were (nothing is written to a
    cache at a caller's request: `cache_creation_input_tokens` is 0)."""
    return {
        "input_tokens": num_prompt - delta.num_cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": delta.num_cached_tokens,
        "output_tokens": delta.num_output_tokens,
    }


def _stop_reason(last: TextDelta, num_calls: int, cut_off: bool) -> str:
    """tool_use once the output ended (by the grammar's end or EOS) on whole calls."""
    if num_calls and not cut_off and last.finish_reason == "stop":
        return "tool_use"
    return STOP_REASONS.get(last.finish_reason or "", "end_turn")


def finish(message: dict[str, Any], text: str, last: TextDelta, tools: bool) -> dict[str, Any]:
    """The whole Message: its content (with `tools`, the output read back as text and
    calls), stop reason and usage."""
    if tools:
        parsed = parse_output(text)
        content: list[dict[str, Any]] = [{"type": "text", "text": parsed.text}] * bool(parsed.text)
        content += [
            {"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": call.arguments}
            for call in parsed.calls
        ]
        message["stop_reason"] = _stop_reason(last, len(parsed.calls), parsed.cut_off)
    else:
        content = [{"type": "text", "text": text}]
        message["stop_reason"] = STOP_REASONS.get(last.finish_reason or "", "end_turn")
    message["content"] = content
    message["stop_sequence"] = last.stop_sequence
    num_prompt = message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"]
    message["usage"] = usage(num_prompt, last)
    return message


class _Blocks:
    """A streamed Message's content blocks, each opened when its first piece comes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.num_calls = 0

    def open_text(self) -> list[bytes]:
        return [] if self.open == "text" else self._start({"type": "text", "text": ""})

    def text(self, text: str) -> list[bytes]:
        events = self.open_text()
        delta = {"type": "text_delta", "text": text}
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return [*events, sse_event(event, "content_block_delta")]

    def tool_events(self, events: list[ToolEvent]) -> list[bytes]:
        out: list[bytes] = []
        for event in events:
            if isinstance(event, PlainText):
                out += self.text(event.text)
            elif isinstance(event, CallStart):
                self.num_calls += 1
                block = {"type": "tool_use", "id": tool_use_id(), "name": event.name, "input": {}}
                out += self._start(block)
            elif isinstance(event, CallArguments):
                delta = {"type": "input_json_delta", "partial_json": event.text}
                data = {"type": "content_block_delta", "index": self.index, "delta": delta}
                out.append(sse_event(data, "content_block_delta"))
        return out

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, sse_event(start, "content_block_start")]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        stop = {"type": "content_block_stop", "index": self.index}
        return [sse_event(stop, "content_block_stop")]


async def stream(
    message: dict[str, Any], deltas: AsyncGenerator[TextDelta, None], tools: bool
) -> AsyncIterator[bytes]:
    """The events of a streamed Message. message_start goes out before the first token,
    when the prefix cache's share of the prompt is not known yet: its usage counts the
    whole prompt as input; message_delta's usage has the final counts, cache reads
    included (the SDKs' accumulators take them from there). Without tools the text block
    opens at once, as before any token."""
    num_prompt = message["usage"]["input_tokens"]
    yield sse_event({"type": "message_start", "message": message}, "message_start")
    blocks = _Blocks()
    parser = ToolStreamParser() if tools else None
    for event in [] if parser else blocks.open_text():
        yield event
    yield sse_event({"type": "ping"}, "ping")
    last = None
    async with contextlib.aclosing(deltas):
        try:
            async for delta in deltas:
                last = delta
                if not delta.text:
                    continue
                if parser is None:
                    events = blocks.text(delta.text)
                else:
                    events = blocks.tool_events(parser.feed(delta.text))
                for event in events:
                    yield event
        except APIError as exc:
            yield sse_event(anthropic_error_body(exc.kind, exc.message), "error")
            return
        except Exception:
            logger.exception("stream failed after its 200")
            yield sse_event(anthropic_error_body("internal", "internal server error"), "error")
            return
    assert last is not None and last.finish_reason is not None
    cut_off = False
    if parser is not None:
        rest, cut_off = parser.finish()
        for event in blocks.tool_events(rest):
            yield event
    for event in blocks.close():
        yield event
    if parser is None:
        reason = STOP_REASONS.get(last.finish_reason, "end_turn")
    else:
        reason = _stop_reason(last, blocks.num_calls, cut_off)
    stop = {"stop_reason": reason, "stop_sequence": last.stop_sequence}
    data = {"type": "message_delta", "delta": stop, "usage": usage(num_prompt, last)}
    yield sse_event(data, "message_delta")
    yield sse_event({"type": "message_stop"}, "message_stop")
