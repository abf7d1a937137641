"""The engine process's wire protocol: what the gateway and the engine send over ZMQ (msgpack).

The gateway sends EngineInput (add, abort, shutdown); the engine sends EngineMessage (ready,
rejected, one step's outputs).
"""

from __future__ import annotations

import msgspec

from tokenfleet.core.engine_api import EngineCoreOutputs, EngineCoreRequest


class AddRequests(msgspec.Struct, tag="add"):
    # What the sender submitted in one turn of its event loop, in order: a burst's requests
    # travel together, one message and one wake-up of each side's I/O for all of them.
    requests: list[EngineCoreRequest]
    # How many more requests the sender has taken in and not sent yet (HTTP requests the
    # gateway is still parsing), counted as it submitted the last of these: an idle engine
    # waits for them before its first step. None: the sender cannot tell, so the engine
    # guesses from the gaps between arrivals.
    num_pending: int | None = None
    # The sender counted num_pending after its event loop had polled its sockets again since
    # the last of these was submitted (AsyncEngineClient._end_turn): what had reached it by
    # then is counted, so an idle engine told 0 after a burst starts at once. Such a message
    # may carry no request: it only says how many are still pending.
    counted_after_poll: bool = False


class AbortRequests(msgspec.Struct, tag="abort"):
    req_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = AddRequests | AbortRequests | Shutdown


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded: what the gateway needs to validate requests."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int]


class RequestRejected(msgspec.Struct, tag="rejected"):
    """The engine refused a request (the gateway validates first, so this is rare)."""

    req_id: str
    message: str
    param: str | None = None


class StepOutputs(msgspec.Struct, tag="step"):
    """One engine step's outputs, or a heartbeat (no outputs) while the engine is idle."""

    outputs: EngineCoreOutputs


EngineMessage = EngineReady | RequestRejected | StepOutputs
