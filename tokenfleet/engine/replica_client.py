"""ReplicaClient: all the gateway knows of the replicas it serves from (DESIGN.md).

Two kinds: AsyncEngineClient (engine/client.py), one engine process on this machine, the
default; and FleetClient (cluster/client.py), any number of replicas on Ray, with routing
and failover inside it. The gateway's code is the same over both.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Protocol

from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tokenfleet.engine.wire import EngineReady
from tokenfleet.policy.admission import Verdict

if TYPE_CHECKING:
    from tokenfleet.engine.client import RequestOutputs


class ReplicaClient(Protocol):
    config: EngineConfig
    # Set by the gateway: how many requests it has taken in and not submitted yet.
    count_pending: Callable[[], int | None] | None
    startup_timeout_s: float
    restart_backoff_s: float
    restart_backoff_max_s: float
    num_restarts: int
    # Requests moved to another replica after theirs died (a fleet's; 0 for one engine).
    num_moves: int

    @property
    def info(self) -> EngineReady | None: ...

    @property
    def stats(self) -> SchedulerStats | None: ...

    @property
    def pid(self) -> int | None: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def is_healthy(self) -> bool: ...

    def describe(self) -> list[dict[str, object]]:
        """One row per replica: GET /admin/fleet."""
        ...

    def replica_stats(self) -> dict[str, SchedulerStats]:
        """Each replica's latest stats by id (the `replica` label in /metrics)."""
        ...

    def predict_ttft(self, num_prompt_tokens: int) -> Verdict | None:
        """The fleet's admission verdict for a new interactive prompt, from the replicas'
        reports; None where the gateway's own admission control judges (one engine)."""
        ...

    async def submit(
        self, request: EngineCoreRequest, num_pending: int | None = None
    ) -> RequestOutputs: ...

    def settled(self) -> asyncio.Future[None]: ...

    def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]: ...

    async def abort(self, req_ids: list[str]) -> None: ...
