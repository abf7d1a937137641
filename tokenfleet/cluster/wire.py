"""What gateways and replicas send each other over a replica's ROUTER socket (msgpack).

A gateway connects a DEALER with its own identity to each replica's ROUTER and sends
AddRequests, AbortRequests (engine/wire.py) and a GatewayPing twice a second; the ping names
the gateway's PULL socket, which the replica connects a PUSH to: there it sends the outputs
of that gateway's requests, one message a step, and a ReplicaBeat every beat from a thread
of its own (a long step is not a silence). One socket each way: a gateway reads every
replica from one socket, and never sends on the socket its reader waits on (zmq.asyncio
would miss a wake-up). Every message from a replica carries its id and incarnation: a
gateway drops any from an incarnation it no longer talks to (Ray can keep two copies of a
replica alive for a while after a node stalls).
"""

from __future__ import annotations

import msgspec

from tokenfleet.core.engine_api import EngineCoreOutputs, SchedulerStats
from tokenfleet.engine.wire import AbortRequests, AddRequests, EngineReady, RequestRejected


class GatewayPing(msgspec.Struct, tag="ping"):
    """The gateway is alive, and reads replies at `reply_to`. A replica aborts the requests
    of a gateway it has not heard from for its gateway timeout (the gateway died: nobody
    reads those streams)."""

    reply_to: str


FleetInput = AddRequests | AbortRequests | GatewayPing


class ReplicaBeat(msgspec.Struct, tag="beat"):
    replica_id: int
    incarnation: int
    # None while the model loads (state "starting").
    info: EngineReady | None
    stats: SchedulerStats | None
    # Median time between the engine's recent steps with work, and how long the step in
    # progress has run (0 when idle).
    step_ms_p50: float | None
    step_running_s: float
    # The bridge's count of requests it holds per gateway (this one's).
    num_requests: int
    # The mean interval between busy steps since the previous beat, None without one: the
    # slow rule's window (health.py). Last, with a default: an older replica omits it.
    step_ms_window: float | None = None


class ReplicaOutputs(msgspec.Struct, tag="outputs"):
    replica_id: int
    incarnation: int
    outputs: EngineCoreOutputs


class ReplicaRejected(msgspec.Struct, tag="rejected"):
    replica_id: int
    incarnation: int
    rejected: RequestRejected


FleetMessage = ReplicaBeat | ReplicaOutputs | ReplicaRejected


_decoder: msgspec.msgpack.Decoder[FleetMessage] = msgspec.msgpack.Decoder(FleetMessage)


def decode_message(data: bytes) -> FleetMessage:
    return _decoder.decode(data)
