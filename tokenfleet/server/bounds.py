"""Bounds on what a request may ask, checked at the gateway before anything reaches the
engine: numbers within what the engine, torch and the wire codec (msgpack: int64/uint64)
hold, and counts, lengths and depths a caller cannot blow up. One place for the limits;
the request models (anthropic_api, openai_api) and the checks below use them."""

from __future__ import annotations

import sys
from typing import Any

from tokenfleet.server.errors import APIError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The largest int64 that /openapi.json states exactly (its numbers are doubles): the upper
# bound of every int field, so that the schema and the server agree on it.
JSON_INT_MAX = 2**63 - 1024
# Seeds: torch.Generator.manual_seed takes [-2**63, 2**64 - 1], msgpack int64 or uint64;
# OpenAI's seed is an int64. Choice i of n runs with seed + i: that must fit too.
SEED_MIN, SEED_MAX = INT64_MIN, JSON_INT_MAX
TOP_K_MAX = JSON_INT_MAX  # past the vocabulary it means "off" (see clamp_top_k)
MAX_TOKENS_MAX = JSON_INT_MAX  # and then checked against the context (service.check_length)

MAX_MESSAGES = 100_000  # Anthropic's own limit on messages per request
MAX_CONTENT_BLOCKS = 10_000  # text blocks in one message or in `system`
MAX_TOOL_ID_CHARS = 256  # a tool call's id in an earlier turn (ours are 30)
MAX_STOP_SEQUENCES_ANTHROPIC = 16
MAX_STOP_SEQUENCES_OPENAI = 4  # OpenAI's documented limit
MAX_STOP_CHARS = 1024  # one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries (OpenAI's own limit is 300 tokens; vLLM takes more)
MAX_PROMPT_TOKEN_IDS = 1_000_000  # one prompt as token ids (the context bounds it later)
MAX_PROMPTS = 2048  # completions: prompts in one request (before the engine-request cap)
MAX_JSON_DEPTH = 32  # nesting of any request body (metadata, unknown fields, ...)
MAX_METADATA_USER_ID = 256  # Anthropic's metadata.user_id
MAX_N = 16

MAX_CURSOR_CHARS = 128  # list routes' after/before ids (the store's ids are far shorter)
CURSOR_PATTERN = r"^[A-Za-z0-9_-]+$"  # what the store's ids are made of
MAX_CUSTOM_ID_CHARS = 512  # OpenAI batches: any string, within this


def check_engine_requests(count: int, limit: int, param: str) -> None:
    """A 400 when one API request would become more than `limit` engine requests."""
    if count > limit:
        raise APIError(
            400,
            "invalid_request",
            f"{param}: this request asks for {count} generations (prompts x n), more than "
            f"the {limit} one request may make",
            param=param,
        )


def json_depth_exceeds(data: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether decoded JSON nests deeper than `limit` arrays/objects (iterative: a deep
    body cannot exhaust the stack here)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def check_json_depth(data: object, param: str | None = None) -> None:
    if json_depth_exceeds(data):
        where = f"{param}: " if param else ""
        raise APIError(
            400,
            "invalid_request",
            f"{where}JSON nested deeper than {MAX_JSON_DEPTH} levels",
            param=param,
        )


# A positive temperature under this divides the float32 logits past what they hold (1e-40
# is subnormal in float32, 1e-300 is 0): the request would fail in the sampler with a 500.
# Raised to it, it samples as the caller meant: the largest logit, bar ties within ~1e-5.
MIN_TEMPERATURE = 1e-6


def clamp_temperature(temperature: float) -> float:
    """A positive temperature at least MIN_TEMPERATURE (0 stays greedy)."""
    return max(temperature, MIN_TEMPERATURE) if temperature > 0 else temperature


# A subnormal top_p (5e-324, which the API's (0, 1] takes) is a value the engine's float
# code need not keep (a process that flushes subnormals to zero reads it as 0 and would
# refuse the request after a stream's 200). Raised to the smallest normal float, it keeps
# the same most likely token.
MIN_TOP_P = sys.float_info.min


def clamp_top_p(top_p: float) -> float:
    """top_p at least MIN_TOP_P: a number the engine reads as the caller sent it."""
    return max(top_p, MIN_TOP_P)


def clamp_top_k(top_k: int, vocab: int) -> int:
    """top_k at or past the vocabulary keeps every token: the same as off (0), and a number
    every tensor holds."""
    return 0 if top_k >= vocab else top_k


def check_seed(seed: int | None, n: int) -> None:
    """Choice i runs with seed + i: the last one must still be a 64-bit seed."""
    if seed is not None and seed + n - 1 > SEED_MAX:
        raise APIError(
            400,
            "invalid_request",
            f"seed: seed + n - 1 must be at most {SEED_MAX} (each choice i runs with seed + i)",
            param="seed",
        )
