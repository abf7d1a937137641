"""JSON schemas the constrained-decoding benchmarks build."""

from __future__ import annotations

from typing import Any


def closed_object(properties: dict[str, Any]) -> dict[str, Any]:
    """An object schema of these properties, each required, no other key allowed (else a
    small model adds keys of its own until max_tokens)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
