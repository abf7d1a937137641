"""Text <-> token ids and the chat template, from a model folder's tokenizer files.

Uses the `tokenizers` library and a sandboxed jinja2 environment, as Hugging Face renders
chat templates; transformers itself is not needed.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from tokenfleet.errors import InvalidRequestError, ModelLoadError


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content"))
    return None if value is None else str(value)


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"model folder {folder} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.chat_template: str | None = config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(self.chat_template) if self.chat_template else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        token = self._tok.id_to_token(token_id)
        return None if token is None else str(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise InvalidRequestError("this model has no chat template", param="messages")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template: {exc}", param="messages") from exc
