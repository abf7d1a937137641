"""Driving an EngineCore directly in tests: every request's stream, step by step."""

from __future__ import annotations

from typing import NamedTuple

from tokenfleet.core.engine_api import EngineCoreRequest, TokenLogprobs
from tokenfleet.engine.core import EngineCore


class Stream(NamedTuple):
    tokens: list[int]
    finish_reason: str | None
    stop_token_id: int | None
    logprobs: list[TokenLogprobs]
    error: str | None = None


def run_streams(core: EngineCore, requests: list[EngineCoreRequest]) -> list[Stream]:
    """Each request's stream, all added before the first step (batched together); the
    engine is left with no KV block in use."""
    for request in requests:
        core.add_request(request)
    streams = {r.req_id: Stream([], None, None, []) for r in requests}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            stream = streams[out.req_id]
            stream.tokens.extend(out.new_token_ids)
            stream.logprobs.extend(out.logprobs or [])
            if out.finished:
                streams[out.req_id] = stream._replace(
                    finish_reason=out.finish_reason,
                    stop_token_id=out.stop_token_id,
                    error=out.error,
                )
    assert core.kv.pool.num_used_blocks == 0
    return [streams[r.req_id] for r in requests]
