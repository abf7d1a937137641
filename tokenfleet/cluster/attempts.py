"""A request of a gateway wherever it runs in the fleet: the replica it is on now, its
attempt (each move to another replica is one more), and the tokens its caller has already
received, which a later attempt carries so that the new replica goes on from them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.request import PRIORITY_INTERACTIVE
from tokenfleet.engine.client import Arrival


@dataclass
class MovingRequest:
    """One request of this gateway, wherever it runs now."""

    request: EngineCoreRequest
    queue: asyncio.Queue[Arrival | Exception]
    replica_id: int = -1
    attempt: int = 0
    received: list[int] = field(default_factory=list)  # output tokens passed to the caller
    routed_tokens: int = 0  # what the router was told it has to prefill
    first_seen: bool = False
    parked_at: float | None = None  # waiting for a replica to move to since then
    num_drain_moves: int = 0  # moves off a draining replica (not counted in max_moves)

    @property
    def engine_id(self) -> str:
        """The engine request id of the current attempt: outputs of an older attempt (a
        replica that speaks late) carry another and are dropped."""
        return f"{self.request.req_id}/{self.attempt}"

    @property
    def interactive(self) -> bool:
        return self.request.priority <= PRIORITY_INTERACTIVE

    def engine_request(self) -> EngineCoreRequest:
        """The engine request of the current attempt: a later one carries the tokens the
        caller has received, and no prompt logprobs (the first attempt sent them)."""
        request = self.request
        if not self.attempt:
            return msgspec.structs.replace(request, req_id=self.engine_id)
        params = request.sampling_params
        if params.prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        return msgspec.structs.replace(
            request,
            req_id=self.engine_id,
            sampling_params=params,
            output_token_ids=list(self.received),
        )
