"""The engine process: an EngineCore driven over ZMQ, one message out per engine step.

    gateway --PUSH ipc://.../in--> [engine process] --PUSH ipc://.../out--> gateway
             AddRequests | AbortRequests | Shutdown     EngineReady, then StepOutputs per step
                                                         (an empty one every heartbeat when idle)

Inputs are drained between steps, never during one. Run as
`python -m tokenfleet.engine.process IN_ADDR OUT_ADDR CONFIG_JSON`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import signal
import sys
import time
from collections.abc import Callable

import msgspec
import zmq

from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.wire import (
    AbortRequests,
    EngineReady,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from tokenfleet.errors import InvalidRequestError

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
ARRIVAL_GAP_MS = 1  # waking from idle, wait this long for one more arrival...
BURST_GAP_MS = 5  # ...or this long once two or more came (a burst; a pause in the gateway)
ARRIVAL_WINDOW_STEP_SHARE = 0.5  # ...but in all no longer than this share of a recent step
ARRIVAL_WINDOW_MAX_S = 0.1  # (and never longer than this)
FIRST_STEP_GUESS_S = 0.02  # before any step was timed
COMPILE_POLL_MS = 1  # while the only requests wait for their constraints' compiles


def _die_with_parent() -> None:
    # Linux: SIGKILL this process when the gateway that started it dies.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def arrival_gap_ms(
    arrivals: int,
    num_pending: int | None,
    window_left_ms: float,
    announced: bool = False,
    counted_after_poll: bool = False,
) -> int:
    """How long an engine waking from idle waits for one more arrival before its first step,
    so that a burst lands in the same first step instead of queueing behind the first
    request's prefill.

    - The sender says more requests are pending (the gateway is still parsing them): the
      rest of the window, so that a collector pause or a busy gateway core does not split
      the burst.
    - It says none is, after an earlier request of this window said some were
      (`announced`): the burst is in. Counted after the sender polled its sockets again
      (`counted_after_poll`), nothing else can be in flight: no wait; otherwise the short
      gap for stragglers.
    - Otherwise (none pending from the first, or the sender cannot tell): the short gap
      for a lone request, a longer one within a burst, because the gateway counts only
      the requests whose headers it has read, not those still in its sockets.
    """
    if num_pending:
        return max(1, math.ceil(window_left_ms))
    if announced and num_pending == 0:
        return 0 if counted_after_poll else ARRIVAL_GAP_MS
    return BURST_GAP_MS if arrivals > 1 else ARRIVAL_GAP_MS


class _RawAddRequests(msgspec.Struct, tag="add"):
    """wire.AddRequests with each request left undecoded: decoded one by one
    (decode_requests), so that one the engine cannot read is refused alone instead of
    failing the whole message (and the process with it)."""

    requests: list[msgspec.Raw]
    num_pending: int | None = None
    counted_after_poll: bool = False


_RawInput = _RawAddRequests | AbortRequests | Shutdown


class _RequestId(msgspec.Struct):
    req_id: str


_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_request_id_decoder = msgspec.msgpack.Decoder(_RequestId)


def decode_requests(
    raws: list[msgspec.Raw],
) -> tuple[list[EngineCoreRequest], list[RequestRejected]]:
    """Each request of an AddRequests decoded on its own: those that decode, and a
    rejection for each one that does not (a value out of its field's range, say)."""
    requests, rejected = [], []
    for raw in raws:
        try:
            requests.append(_request_decoder.decode(raw))
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:
            try:
                req_id = _request_id_decoder.decode(raw).req_id
            except msgspec.DecodeError:
                # No id to answer to: the gateway's codec and ours disagree.
                logger.error("a request without a readable id was dropped: %s", exc)
                continue
            message = f"the engine could not read the request: {exc}"
            rejected.append(RequestRejected(req_id, message))
    return requests, rejected


def encode_step(
    encoder: msgspec.msgpack.Encoder,
    outputs: EngineCoreOutputs,
    fail: Callable[[dict[str, str]], list[EngineCoreOutput]],
) -> bytes:
    """One step's message. Should it not encode, each output is tried alone and the
    requests whose outputs do not encode are ended with an error (`fail`, which frees
    them in the engine and gives their error outputs), sent in their place: a request's
    output fails that request, never the step's others, nor silently."""
    try:
        return encoder.encode(StepOutputs(outputs))
    except (TypeError, ValueError, OverflowError):
        pass
    kept: list[EngineCoreOutput] = []
    errors: dict[str, str] = {}
    for output in outputs.outputs:
        try:
            encoder.encode(output)
        except (TypeError, ValueError, OverflowError) as exc:
            errors[output.req_id] = f"its output could not be encoded: {type(exc).__name__}"
            logger.error("request %s: its output could not be encoded: %s", output.req_id, exc)
        else:
            kept.append(output)
    kept += fail(errors)
    # Still failing: the message itself (its stats), not a request's: a fault of the process.
    return encoder.encode(StepOutputs(EngineCoreOutputs(kept, outputs.timestamp, outputs.stats)))


def run_engine(in_addr: str, out_addr: str, config: EngineConfig) -> None:
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # exit at once, even with messages the gateway never read
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(in_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(out_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(_RawInput)

    core = EngineCore(config)
    outputs.send(
        encoder.encode(
            EngineReady(
                max_model_len=core.max_model_len,
                num_kv_blocks=core.kv.pool.num_blocks,
                block_size=config.cache.block_size,
                vocab_size=core.model_config.vocab_size,
                eos_token_ids=list(core.model_config.eos_token_ids),
            )
        )
    )
    last_sent = time.monotonic()
    step_s = FIRST_STEP_GUESS_S  # the last step's duration
    while True:
        busy = core.has_step_work()
        if busy:
            timeout_ms = 0
        elif core.has_unfinished_requests():  # compiles pending: check on them soon
            timeout_ms = COMPILE_POLL_MS
        else:
            timeout_ms = int(HEARTBEAT_INTERVAL_S * 1000)
        if inputs.poll(timeout_ms):
            # A burst that reaches an idle engine one request at a time (each has its own way
            # through the gateway) should share the first step: starting on the first arrival
            # alone would make every later one wait a whole step. Waiting is worth it while it
            # is short next to a step, hence the window's cap.
            window_s = min(ARRIVAL_WINDOW_MAX_S, ARRIVAL_WINDOW_STEP_SHARE * step_s)
            window_end = time.monotonic() + window_s
            arrivals = 0
            num_pending: int | None = None  # as the latest request's sender counted them
            announced = False  # an earlier request of this window said more were coming
            counted_after_poll = (
                False  # ...and whether the latest count was made after a fresh poll
            )
            while True:
                try:
                    message = decoder.decode(inputs.recv(zmq.NOBLOCK))
                except zmq.Again:
                    if busy:
                        break
                    left_ms = (window_end - time.monotonic()) * 1000
                    gap_ms = arrival_gap_ms(
                        arrivals, num_pending, left_ms, announced, counted_after_poll
                    )
                    if left_ms > 0 and inputs.poll(gap_ms):
                        continue
                    break
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AbortRequests):
                    core.abort(message.req_ids)
                elif isinstance(message, _RawAddRequests):
                    arrivals += len(message.requests)
                    # Requests sent together came together: the sender saw a burst.
                    announced = announced or bool(num_pending) or len(message.requests) > 1
                    num_pending, counted_after_poll = (
                        message.num_pending,
                        message.counted_after_poll,
                    )
                    requests, refused = decode_requests(message.requests)
                    for request in requests:
                        try:
                            core.add_request(request)
                        except InvalidRequestError as exc:
                            refused.append(RequestRejected(request.req_id, exc.message, exc.param))
                        except Exception as exc:  # this request's alone: the others go on
                            logger.exception("request %s could not be added", request.req_id)
                            message_text = f"the engine could not take the request: {exc!r}"
                            refused.append(RequestRejected(request.req_id, message_text[:500]))
                    for rejected in refused:
                        outputs.send(_encode_rejection(encoder, rejected))
        if core.has_step_work():
            started = time.monotonic()
            outputs.send(encode_step(encoder, core.step(), core.fail_requests))
            last_sent = time.monotonic()
            step_s = last_sent - started
        elif time.monotonic() - last_sent >= HEARTBEAT_INTERVAL_S:
            heartbeat = EngineCoreOutputs([], timestamp=time.time(), stats=core.stats())
            outputs.send(encoder.encode(StepOutputs(heartbeat)))
            last_sent = time.monotonic()


def _encode_rejection(encoder: msgspec.msgpack.Encoder, rejected: RequestRejected) -> bytes:
    try:
        return encoder.encode(rejected)
    except (TypeError, ValueError, OverflowError):  # its message, not its id: both are str
        return encoder.encode(RequestRejected(rejected.req_id, "the request was refused"))


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s: %(message)s")
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Ctrl-C in a terminal reaches the whole process group: the gateway stops this engine
    # itself (a Shutdown message, or SIGKILL through PR_SET_PDEATHSIG if it dies first).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    in_addr, out_addr, config_json = argv
    run_engine(in_addr, out_addr, msgspec.json.decode(config_json, type=EngineConfig))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
