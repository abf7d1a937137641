"""What the tool-use and structured-output tests share: two tools (as each API declares
them), and an OpenAI batch run through the official client to its results."""

from __future__ import annotations

import json
import time
from typing import Any

import openai

# Two tools, their input schemas closed (no keys of the model's own).
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
DESCRIPTIONS = {
    "get_weather": "The weather in a city now.",
    "get_time": "The local time in a time zone.",
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}


def anthropic_tool(name: str) -> dict[str, Any]:
    return {"name": name, "description": DESCRIPTIONS[name], "input_schema": SCHEMAS[name]}


def openai_tool(name: str) -> dict[str, Any]:
    function = {"name": name, "description": DESCRIPTIONS[name], "parameters": SCHEMAS[name]}
    return {"type": "function", "function": function}


def openai_batch_results(
    client: openai.OpenAI, bodies: dict[str, dict[str, Any]], timeout: float
) -> dict[str, dict[str, Any]]:
    """Chat bodies by custom id, run as one batch (Files + Batches): each result line by
    custom id, once the batch completed."""
    lines = [
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
        for custom_id, body in bodies.items()
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("batch.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.5)
    assert batch.status == "completed" and batch.output_file_id is not None
    content = client.files.content(batch.output_file_id).content.decode()
    results = {r["custom_id"]: r for r in map(json.loads, content.splitlines())}
    assert sorted(results) == sorted(bodies)
    return results
