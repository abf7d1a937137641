"""The request models' place in the OpenAPI schema, and null as "absent".

Bodies are read by hand (body.read_body: msgspec, then the pydantic model), faster than
FastAPI's body params; `request_body(Model)` declares the same model as the route's body in
/openapi.json (through `openapi_extra`), so that the schema says what each route takes,
bounds included, without changing how the body is parsed.

Fields that the official APIs accept as null (temperature, top_p, stream, ...) are listed
in a model's NULL_IS_DEFAULT: `drop_nulls` reads such a null as the field left out (its
default), and `nullable_fields` says so in the schema.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel


def drop_nulls(cls: type[BaseModel], data: Any) -> Any:
    """A model_validator(mode="before"): a null in a NULL_IS_DEFAULT field is its default."""
    names: tuple[str, ...] = getattr(cls, "NULL_IS_DEFAULT", ())
    if isinstance(data, dict) and names and any(data.get(n, 0) is None for n in names):
        return {k: v for k, v in data.items() if not (v is None and k in names)}
    return data


def nullable_fields(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """json_schema_extra: the NULL_IS_DEFAULT fields may be null."""
    properties = schema.get("properties", {})
    for name in getattr(cls, "NULL_IS_DEFAULT", ()):
        prop = properties.get(name)
        if prop is None or any(o.get("type") == "null" for o in prop.get("anyOf", ())):
            continue
        outer = {k: prop[k] for k in ("title", "default", "description") if k in prop}
        inner = {k: v for k, v in prop.items() if k not in outer}
        properties[name] = {**outer, "anyOf": [inner, {"type": "null"}]}


def _inline(node: Any, defs: dict[str, Any], depth: int = 0) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/") and depth < 16:
            target = copy.deepcopy(defs[ref.removeprefix("#/$defs/")])
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return _inline({**target, **rest}, defs, depth + 1)
        return {k: _inline(v, defs, depth) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs, depth) for v in node]
    return node


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema, self-contained (its $defs inlined: none is recursive)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return _inline(schema, defs)  # type: ignore[no-any-return]


def request_body(model: type[BaseModel], media_type: str = "application/json") -> dict[str, Any]:
    """`openapi_extra` for a route whose body `model` describes."""
    return {
        "requestBody": {
            "required": True,
            "content": {media_type: {"schema": json_schema(model)}},
        }
    }
