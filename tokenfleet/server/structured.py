"""Structured output on both APIs: OpenAI's `response_format` and Anthropic's
`output_config.format`, read into the engine's constraint (core.sampling_params.Constraint).

    OpenAI    {"type": "text"}                                        no constraint
              {"type": "json_object"}                                 any JSON object
              {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    Anthropic {"format": {"type": "json_schema", "schema": {...}}}    the text block holds
                                                                      the JSON

A schema is checked here, before the request is accepted: llguidance (the replicas'
grammar library) reads it, and a feature it does not implement is a 400 that names it
(`uniqueItems`, say), instead of a request that fails on its replica. The check is cached
by schema: a batch of 100,000 requests over a few schemas pays it a few times.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field

from tokenfleet.core.sampling_params import MAX_CONSTRAINT_SPEC_CHARS, Constraint
from tokenfleet.server.errors import APIError

SCHEMA_CHECKS_CACHED = 1024


class JSONSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


class JSONOutputFormat(BaseModel):
    """Anthropic's `output_config.format`."""

    model_config = ConfigDict(strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Anthropic's `output_config`: a format; `effort` is not served (a 400 names it)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    format: JSONOutputFormat | None = None
    effort: str | None = None


def schema_constraint(schema: dict[str, Any], param: str) -> Constraint:
    """A JSON schema's constraint, or a 400 at `param` saying what in it cannot be served."""
    # Key order kept: the output lists an object's properties in the schema's order.
    spec = json.dumps(schema, separators=(",", ":"))
    if len(spec) > MAX_CONSTRAINT_SPEC_CHARS:
        message = (
            f"{param}: the schema is {len(spec)} characters as JSON, over the limit of "
            f"{MAX_CONSTRAINT_SPEC_CHARS}"
        )
        raise APIError(400, "invalid_request", message, param=param)
    problem = schema_problem(spec)
    if problem:
        message = f"{param}: the schema is not supported: {problem}"
        raise APIError(400, "invalid_request", message, param=param)
    return Constraint("json_schema", spec)


@functools.lru_cache(maxsize=SCHEMA_CHECKS_CACHED)
def schema_problem(spec: str) -> str:
    """What llguidance cannot serve in the schema (a JSON text), in its own words, which
    name an unimplemented keyword; "" if nothing."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(spec)
    except (ValueError, TypeError) as exc:
        return str(exc)
    error: str = llguidance.LLMatcher.validate_grammar(grammar, None)
    return error.strip()


def openai_constraint(
    response_format: TextFormat | JSONObjectFormat | JSONSchemaResponseFormat | None,
    mentions_json: bool,
) -> Constraint | None:
    """`response_format`'s constraint. json_object asks that the messages mention JSON, as
    OpenAI's API does (else a model may write whitespace until max_tokens)."""
    if response_format is None or isinstance(response_format, TextFormat):
        return None
    if isinstance(response_format, JSONObjectFormat):
        if not mentions_json:
            message = (
                "'messages' must contain the word 'json' in some form, to use "
                "'response_format' of type 'json_object'."
            )
            raise APIError(400, "invalid_request", message, param="messages")
        return Constraint("json_object")
    schema = response_format.json_schema.schema_
    if schema is None:  # no schema given: any JSON object
        return Constraint("json_object")
    return schema_constraint(schema, "response_format.json_schema.schema")


def anthropic_constraint(output_config: OutputConfig | None) -> Constraint | None:
    """`output_config`'s constraint (its format's schema)."""
    if output_config is None:
        return None
    if output_config.effort is not None:
        message = "output_config.effort: effort levels are not supported by this server"
        raise APIError(400, "invalid_request", message, param="output_config.effort")
    if output_config.format is None:
        return None
    return schema_constraint(output_config.format.schema_, "output_config.format.schema")
