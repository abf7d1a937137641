"""A pool of replicas that serve the same traffic, and the three fleet policies.

A pool takes interactive traffic (through the router), batch work (through the
dispatcher's leasing), or both, and may be autoscaled. A fleet policy is a set of pools:

    separate   an interactive pool and a batch pool (priority scheduling in each; batch
               replicas never see an interactive request, so never need the harvest)
    fcfs       one pool, both kinds, the engine's scheduling_policy="fcfs": one class in
               arrival order, no harvest budget
    priority   one pool, both kinds, priority classes + the harvest budget
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet.fleet.autoscaler import Autoscaler, AutoscalerConfig, BatchRateMeter
from tokenfleet.sim.replica import SimReplica

FLEET_POLICIES = ("separate", "fcfs", "priority")


@dataclass(frozen=True)
class PoolSpec:
    name: str
    interactive: bool
    batch: bool
    policy: str  # the replicas' scheduling policy: "priority" or "fcfs"
    replicas: int
    autoscaler: AutoscalerConfig | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1 or not (self.interactive or self.batch):
            raise ValueError(f"pool {self.name!r}: needs replicas and some traffic")


@dataclass(frozen=True)
class FleetPolicy:
    name: str
    pools: tuple[PoolSpec, ...]


def fleet_policy(
    name: str,
    replicas: int,
    *,
    interactive_replicas: int | None = None,
    autoscaler: AutoscalerConfig | None = None,
) -> FleetPolicy:
    """One of FLEET_POLICIES over `replicas` in all; `separate` gives the interactive pool
    `interactive_replicas` of them (half by default)."""
    if name == "separate":
        num_interactive = interactive_replicas or max(1, replicas // 2)
        if not 1 <= num_interactive < replicas:
            raise ValueError("separate pools need 1 <= interactive_replicas < replicas")
        return FleetPolicy(
            name,
            (
                PoolSpec("interactive", True, False, "priority", num_interactive, autoscaler),
                PoolSpec("batch", False, True, "priority", replicas - num_interactive, autoscaler),
            ),
        )
    if name in ("fcfs", "priority"):
        return FleetPolicy(name, (PoolSpec(name, True, True, name, replicas, autoscaler),))
    raise ValueError(f"fleet policy must be one of {FLEET_POLICIES}, got {name!r}")


@dataclass
class Pool:
    """A pool's replicas at run time: serving, draining (finishing what they hold before
    they go) and asked for but still starting; its autoscaler when it has one (the
    fleet's own `Autoscaler`, fed a window every `window_s`)."""

    index: int
    spec: PoolSpec
    replicas: dict[int, SimReplica] = field(default_factory=dict)
    serving: list[int] = field(default_factory=list)  # take new work, in id order
    draining: set[int] = field(default_factory=set)
    num_starting: int = 0
    started_at: dict[int, float] = field(default_factory=dict)
    batch_in_flight: dict[int, int] = field(default_factory=dict)
    scaler: Autoscaler | None = field(init=False)
    batch_meter: BatchRateMeter | None = field(init=False)
    # The autoscaler's window: interactive requests finished and those within targets;
    # batch output tokens of the requests finished (ever), and those made by the previous
    # window's end.
    window_finished: int = 0
    window_met: int = 0
    batch_tokens_done: int = 0
    batch_tokens_seen: int = 0

    def __post_init__(self) -> None:
        config = self.spec.autoscaler
        self.scaler = None if config is None else Autoscaler(config)
        self.batch_meter = None if config is None else BatchRateMeter(config.batch_settle_s)

    @property
    def size(self) -> int:
        """Replicas the autoscaler counts: serving and starting."""
        return len(self.serving) + self.num_starting

    def kv_usage(self, now: float) -> float:
        """KV blocks in use over the blocks of the replicas up (serving and draining)."""
        live = self.replicas.values()
        total = sum(r.kv.pool.num_blocks for r in live)
        return sum(r.blocks_used(now) for r in live) / total if total else 0.0

    def batch_tokens_made(self) -> int:
        """Batch output tokens made so far: by the requests finished, and so far by those
        in the replicas (as of each replica's last step it applied: a leap's steps count
        once it is cut or ends)."""
        live = self.replicas.values()
        in_flight = sum(
            r.num_output_tokens
            for replica in live
            for r in replica.scheduler.requests.values()
            if not r.is_interactive
        )
        return self.batch_tokens_done + in_flight

    def take_window(self, now: float, batch_queued: int) -> tuple[float | None, float]:
        """(SLO attainment, batch output tokens a replica up made per second) since the
        last call, a window of the autoscaler's (0: not measured, BatchRateMeter)."""
        assert self.scaler is not None and self.batch_meter is not None
        attainment = self.window_met / self.window_finished if self.window_finished else None
        made = self.batch_tokens_made()
        tokens, self.batch_tokens_seen = made - self.batch_tokens_seen, made
        start = now - self.scaler.config.window_s
        up = len(self.replicas)  # serving or draining, not starting
        rate = self.batch_meter.close(start, now, tokens, batch_queued, up)
        self.window_finished = self.window_met = 0
        return attainment, rate
