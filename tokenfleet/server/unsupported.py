"""Parameters the APIs define and this server does not serve (images, audio, ...): a
request that asks for one gets a 400 naming it, instead of an answer that silently
ignored it. The request models allow unknown fields, so that a client sending a newer
field at its default value still works; only a value that would change the answer is
refused."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

from tokenfleet.server.errors import APIError

# name -> whether its value asks for nothing (absent, null, empty, or the default)
Unasked = Callable[[Any], bool]


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value is False or value == ""


def _one_of(*values: Any) -> Unasked:
    return lambda value: value is None or value in values


OPENAI_CHAT: Mapping[str, tuple[Unasked, str]] = {
    "functions": (_empty, "function calling"),
    "function_call": (_one_of("none"), "function calling"),
    "audio": (_empty, "audio output"),
    "modalities": (lambda v: v is None or v == ["text"], "output other than text"),
    "prediction": (_empty, "predicted outputs"),
    # vLLM's extra sampling parameters (top_k and ignore_eos are served)
    "repetition_penalty": (_one_of(1, 1.0), "repetition_penalty"),
    "min_p": (_one_of(0, 0.0), "min_p"),
    "min_tokens": (_one_of(0), "min_tokens"),
}
OPENAI_MESSAGE: Mapping[str, tuple[Unasked, str]] = {
    "function_call": (_empty, "function calling"),
    "audio": (_empty, "audio"),
}
OPENAI_COMPLETION: Mapping[str, tuple[Unasked, str]] = {
    **{name: OPENAI_CHAT[name] for name in ("repetition_penalty", "min_p", "min_tokens")},
    "suffix": (_empty, "suffix (insertion)"),
}
ANTHROPIC_MESSAGES: Mapping[str, tuple[Unasked, str]] = {
    "thinking": (lambda v: v is None or v == {"type": "disabled"}, "extended thinking"),
    "mcp_servers": (_empty, "MCP servers"),
}


def refuse_unsupported(
    body: BaseModel, fields: Mapping[str, tuple[Unasked, str]], where: str = ""
) -> None:
    """A 400 naming the first field of `fields` that `body` asks for (a value that is not
    its default) among the fields the model does not declare."""
    extra = body.model_extra
    if not extra:  # the common case, on every request's way in
        return
    for name, (unasked, what) in fields.items():
        if name in extra and not unasked(extra[name]):
            param = f"{where}{name}"
            message = f"{param}: {what} is not supported by this server"
            raise APIError(400, "invalid_request", message, param=param)


def text_blocks(value: Any, kinds: tuple[str, ...] = ("text",)) -> Any:
    """A content value's blocks, checked to be of `kinds` only (text, by default): a clear
    error for an image, audio or document block (a plain union would report only that
    the content is not a string). Strings and other shapes pass on to the model's own
    validation."""
    if isinstance(value, list):
        for i, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in kinds:
                raise PydanticCustomError(
                    "unsupported_content",
                    "block {index} is of type '{kind}': this model takes only {kinds} content",
                    {"index": i, "kind": kind, "kinds": _one_of_names(kinds)},
                )
    return value


def _one_of_names(names: tuple[str, ...]) -> str:
    """'a', 'b' or 'c'."""
    quoted = [f"'{name}'" for name in names]
    return " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)
