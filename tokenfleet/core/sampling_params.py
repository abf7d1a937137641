"""Per-request sampling settings, validated once at construction.

A msgspec Struct so that it crosses the process boundary as it is.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from tokenfleet.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency penalties, OpenAI's range
MAX_LOGIT_BIAS = 100.0
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_CONSTRAINT_SPEC_CHARS = 1 << 17  # a JSON schema, regex or grammar of 128 Ki characters

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar"]
# JSON on one line as the model writes it, `{"a": 1, "b": [2, 3]}` (llguidance's options,
# for a schema's "x-guidance"): with free whitespace a small model pads with spaces and
# newlines until max_tokens.
JSON_OPTIONS: dict[str, object] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class Constraint(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a constrained request's output must match, as its specification: the replica
    compiles it against its own tokenizer (runner/grammar.py).

    `kind` "json_schema": `spec` is the schema as JSON text (an object); "json_object":
    any JSON object, `spec` empty; "regex": `spec` is a regular expression the whole
    output matches; "grammar": `spec` is a Lark grammar (llguidance's dialect, which can
    embed JSON schemas with `%json`: a tool call's syntax). Only the form is checked
    here; whether the replica supports every feature it uses is known once it compiles
    it (an unsupported one ends the request with an error that names it).
    """

    kind: ConstraintKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(
                f"constraint: kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}",
                param="constraint",
            )
        if len(self.spec) > MAX_CONSTRAINT_SPEC_CHARS:
            raise InvalidRequestError(
                f"constraint: the {self.kind} spec is {len(self.spec)} characters, over the "
                f"limit of {MAX_CONSTRAINT_SPEC_CHARS}",
                param="constraint",
            )
        if self.kind == "json_object":
            if self.spec:
                raise InvalidRequestError(
                    "constraint: a json_object constraint takes no spec", param="constraint"
                )
        elif not self.spec:
            raise InvalidRequestError(
                f"constraint: a {self.kind} constraint needs a spec", param="constraint"
            )
        elif self.kind == "json_schema":
            try:
                schema = msgspec.json.decode(self.spec)
            except msgspec.DecodeError as exc:
                raise InvalidRequestError(
                    f"constraint: the JSON schema is not valid JSON: {exc}", param="constraint"
                ) from exc
            if not isinstance(schema, dict):
                raise InvalidRequestError(
                    "constraint: the JSON schema must be a JSON object", param="constraint"
                )


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to pick each next token, and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 mean off. `logprobs` None
    returns none; 0 returns the chosen token's logprob; k > 0 adds the top k.
    `prompt_logprobs`, alike, for each prompt token after the first (the model's
    logprob of it given the tokens before it), with the first output.

    `presence_penalty` and `frequency_penalty` (OpenAI's): a token's logit is lowered by
    frequency_penalty times the number of times the request has generated it so far, plus
    presence_penalty if it has generated it at all. `logit_bias`: (token id, bias) pairs
    added to those tokens' logits. Both before temperature, greedy included; logprobs stay
    the model's own.

    `constraint`: the output must match it (a JSON schema, any JSON object, a regex or a
    grammar): tokens it does not allow are never sampled, greedy included, and the request
    ends ("stop") once it is complete. Logprobs stay those of the model's own distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens"
            )
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", param="temperature"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (off) or positive, got {self.top_k}", param="top_k"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", param=name
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}",
                    param=name,
                )
        for token_id, bias in self.logit_bias:
            if isinstance(token_id, bool) or token_id < 0:
                raise InvalidRequestError(
                    f"logit_bias: token id {token_id} is not a token id", param="logit_bias"
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias: the bias of token {token_id} must be between "
                    f"-{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {bias}",
                    param="logit_bias",
                )

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the tokens the request has generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def adjusts_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
