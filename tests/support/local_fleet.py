"""A fleet inside the test's process, for FleetClient's tests: real ReplicaBridges (the
engine loop behind its bridge, over tcp on 127.0.0.1) with the fixed runner, found through a
directory the test controls instead of Ray; it can add, flag and remove replicas as Ray
does for a scale."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from tokenfleet.cluster.attempts import MovingRequest
from tokenfleet.cluster.client import FleetClient
from tokenfleet.cluster.placement import ReplicaDescription
from tokenfleet.cluster.replica import ReplicaBridge
from tokenfleet.cluster.wire import ReplicaOutputs
from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from tokenfleet.core.request import PRIORITY_INTERACTIVE
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.engine.client import RequestOutputs

STEP_S = 0.005  # each engine step sleeps this long: a request of N tokens lasts >= N steps
BOGUS = 7  # a token id the fixed runner never samples
# A bound on waits for events that take milliseconds here: only a hang reaches it.
WAIT_S = 30.0


class StaticDirectory:
    """The replicas a test lists: a bridge (described as Ray's actor would be), or what
    Ray would say instead ("dead", "restarting", "silent"). `add` starts a bridge of the
    config given (a scale-up), `remove` stops one and unlists it."""

    def __init__(
        self, entries: dict[int, ReplicaBridge | str], config: EngineConfig | None = None
    ) -> None:
        self.entries = entries
        self.config = config
        self.restarts: list[int] = []  # replicas the gateway asked to have replaced
        self.calls: list[tuple[str, int] | tuple[str, int, bool]] = []  # scaling's
        self.started: list[ReplicaBridge] = []  # by `add`

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def restart(self, replica_id: int) -> None:
        self.restarts.append(replica_id)

    def add(self, replica_id: int) -> None:
        assert self.config is not None
        self.calls.append(("add", replica_id))
        bridge = ReplicaBridge(self.config, replica_id=replica_id)
        bridge.start()
        self.started.append(bridge)
        self.entries[replica_id] = bridge

    def set_draining(self, replica_id: int, draining: bool) -> None:
        self.calls.append(("set_draining", replica_id, draining))
        entry = self.entries.get(replica_id)
        if isinstance(entry, ReplicaBridge):
            entry.draining = draining

    def remove(self, replica_id: int) -> None:
        self.calls.append(("remove", replica_id))
        entry = self.entries.pop(replica_id, None)
        if isinstance(entry, ReplicaBridge):
            entry.stop()

    async def describe(self, timeout_s: float) -> dict[int, ReplicaDescription | str]:
        found: dict[int, ReplicaDescription | str] = {}
        for replica_id, entry in list(self.entries.items()):
            if isinstance(entry, str):
                found[replica_id] = entry
            else:
                found[replica_id] = ReplicaDescription(
                    replica_id,
                    entry.incarnation,
                    entry.address,
                    "local",
                    os.getpid(),
                    entry.ready,
                    entry.draining,
                )
        return found


@dataclass
class Fleet:
    client: FleetClient
    bridges: list[ReplicaBridge]
    directory: StaticDirectory
    collected: dict[str, list[int]] = field(default_factory=dict)

    def link_of(self, req_id: str) -> int:
        return self.client._requests[req_id].replica_id

    def moving(self, req_id: str) -> MovingRequest:
        return self.client._requests[req_id]

    def stop(self, replica_id: int) -> None:
        """The replica stops beating and its engine stops (a hung or dead replica, as the
        gateway sees it)."""
        self.bridges[replica_id]._stopping.set()


async def until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        await asyncio.sleep(0.005)


@asynccontextmanager
async def fleet(
    config: EngineConfig,
    num_replicas: int,
    *,
    hidden: dict[int, str] | None = None,
    replica_timeout_s: float = 1.5,
    **options: object,
) -> AsyncIterator[Fleet]:
    """`num_replicas` bridges, all ready and connected to a started FleetClient, except
    those in `hidden`, which the directory describes as the value says until the test
    lists them."""
    hidden = hidden or {}
    bridges = [ReplicaBridge(config, replica_id=i) for i in range(num_replicas)]
    for bridge in bridges:
        bridge.start()
    entries = {i: hidden.get(i, bridge) for i, bridge in enumerate(bridges)}
    directory = StaticDirectory(entries, config)
    client = FleetClient(
        config,
        directory,
        replica_timeout_s=replica_timeout_s,
        discover_interval_s=0.05,
        **options,  # type: ignore[arg-type]
    )
    try:
        await client.start()
        shown = [i for i in range(num_replicas) if i not in hidden]
        await until(
            lambda: all(i in client.links and client.links[i].routable for i in shown),
            "every listed replica ready",
        )
        yield Fleet(client, bridges, directory)
    finally:
        await client.shutdown()
        for bridge in bridges + directory.started:
            bridge.stop()


def request(
    req_id: str, max_tokens: int, priority: int = PRIORITY_INTERACTIVE
) -> EngineCoreRequest:
    # Prompts of one length, under a block: no cached prefix for the router to follow.
    prompt = [1, *(ord(c) for c in req_id.rjust(8, "-"))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt, params, time.monotonic(), priority=priority)


async def collect(fleet_: Fleet, outputs: RequestOutputs) -> list[int]:
    """Every token of a request's outputs, in order; they are also visible as they come in
    `fleet_.collected[req_id]`. Raises what the request ended with, if an error."""
    tokens = fleet_.collected.setdefault(outputs.req_id, [])
    reasons = []
    async for output in outputs:
        tokens += output.new_token_ids
        if output.finish_reason is not None:
            reasons.append(output.finish_reason)
    assert reasons == ["length"], reasons
    return tokens


def fenced_outputs(replica_id: int, incarnation: int, engine_id: str) -> ReplicaOutputs:
    """A replica's message finishing `engine_id` with a token the fixed runner never
    samples: taken, it would end the stream at once with the wrong token."""
    output = EngineCoreOutput(engine_id, [BOGUS], finish_reason="stop")
    return ReplicaOutputs(replica_id, incarnation, EngineCoreOutputs([output], time.time()))
