"""The fleet's one autoscaler (`serve --autoscale MIN:MAX`): fleet/autoscaler.py's policy,
run once for the fleet however many gateways serve it, and the gateways' side of it.

    gateway A ──report (every report_s)──▶ ┌ "tokenfleet-autoscaler" (a named, detached Ray
    gateway B ──report──────────────────▶  │  actor; the first gateway creates it, the others
              ◀──order {seq, target}─────  │  find it; one that died is created again by
                 (to the leader only)      │  the next gateway to call it)
                                           │ FleetAutoscaler: sums the reports of a window,
                                           │ closes it every window_s, Autoscaler.decide,
                                           └ request_resources(one bundle a replica)

- **What each gateway reports** (GatewayReport): counts since its previous report, summed
  by the autoscaler (each request finishes in one gateway: nothing is counted twice) —
  interactive requests finished and those within the TTFT and TPOT targets, batch output
  tokens generated (as they reach the gateway: the batch rate) and those of the batch
  requests ended (for the mean output of one); and levels, of which the autoscaler keeps
  each gateway's latest — its queued interactive prefill (its router's, for the requests
  it routed: summed over the gateways), the batch store's pending requests and earliest
  deadline (one value per store, not per gateway: gateways sharing a PostgreSQL report
  the same one), and the replicas it counts starting and ready.
- **Applied once**: the replica counts a window sees, and the orders, are the *leader's*:
  the gateway that reported first, or last scaled by hand, or the next to report once the
  leader has been silent for `STALE_REPORTS` report intervals. An order is handed out
  once (an actor runs one call at a time); the leader applies it through its own Scaler,
  whose drains it then owns.
- **By hand**: POST /admin/fleet/scale on any gateway, within [MIN, MAX] (else a 400),
  tells the autoscaler first (`manual`): a pending order is dropped, the change counts as
  the autoscaler's last (cool-downs run from it, the calm run starts again), and the
  gateway that was asked becomes the leader and scales.

(Over 400 lines: the autoscaler's state, its Ray actor and the gateway's side are the two
ends of one exchange, reports in and orders out, and change together.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenfleet.config import FleetConfig
from tokenfleet.errors import InvalidRequestError
from tokenfleet.fleet.autoscaler import (
    Autoscaler,
    AutoscalerConfig,
    AutoscalerState,
    BatchRateMeter,
    FleetWindow,
)

if TYPE_CHECKING:
    from tokenfleet.cluster.client import FleetClient

logger = logging.getLogger(__name__)

AUTOSCALER_NAME = "tokenfleet-autoscaler"
STALE_REPORTS = 4  # a gateway not heard from for this many report intervals is left out
NUM_EVENTS_KEPT = 64  # decisions (and scales by hand) in GET /admin/fleet
CALL_S = 10.0  # a bound on one call to the actor


def autoscaler_config(fleet: FleetConfig) -> AutoscalerConfig:
    """The policy's settings from the gateway's flags (fleet.autoscale must be set)."""
    assert fleet.autoscale is not None
    low, high = fleet.autoscale
    return AutoscalerConfig(
        min_replicas=low,
        max_replicas=high,
        window_s=fleet.autoscale_window_s,
        down_windows=fleet.autoscale_calm_windows,
        batch_settle_s=fleet.autoscale_batch_settle_s,
        up_cooldown_s=fleet.autoscale_up_cooldown_s,
        down_cooldown_s=fleet.autoscale_down_cooldown_s,
    )


def report_interval(config: AutoscalerConfig) -> float:
    """How often each gateway reports: a few times a window, at most every 5 s."""
    return min(config.window_s / 4, 5.0)


@dataclass(frozen=True)
class GatewayReport:
    gateway_id: str
    num_replicas: int  # starting or ready, as this gateway counts them
    num_starting: int
    num_finished: int = 0  # interactive requests finished since the previous report
    num_met: int = 0  # of those, within the TTFT and TPOT targets
    queued_prefill_tokens: int = 0  # now: routed by this gateway, not yet prefilled
    batch_output_tokens: int = 0  # since the previous report, of the batch requests ended
    num_batch_finished: int = 0  # since the previous report
    store: str | None = None  # the batch store it reads, as an identity
    num_batch_pending: int = 0  # now: queued or leased in that store
    batch_deadline_s: float | None = None  # now: seconds to its earliest pending deadline
    batch_tokens_generated: int = 0  # since the previous report, as they were generated
    num_batch_queued: int = 0  # now: of num_batch_pending, those not leased yet


@dataclass(frozen=True)
class Order:
    seq: int
    target: int
    reason: str


@dataclass
class _Heard:
    report: GatewayReport
    at: float


class FleetAutoscaler:
    """The autoscaler's state, without Ray: reports in, windows closed on `report`'s clock,
    orders out to the leader. `on_target` is told each window's target (request_resources)."""

    def __init__(
        self,
        config: AutoscalerConfig,
        *,
        on_target: Callable[[int], None] = lambda target: None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.policy = Autoscaler(config)
        self.on_target = on_target
        self.wall_clock = wall_clock
        self.stale_s = STALE_REPORTS * report_interval(config)
        self.leader: str | None = None
        self.leader_at = 0.0  # its last report, or its scale by hand
        self.heard: dict[str, _Heard] = {}
        self.stores: dict[str, _Heard] = {}
        self.window_start: float | None = None
        self.num_finished = self.num_met = self.batch_tokens = 0
        self.total_batch_tokens = self.total_batch_finished = 0  # for tokens a request
        self.batch_meter = BatchRateMeter(config.batch_settle_s)
        self.pending: Order | None = None
        self.seq = 0
        self.events: deque[dict[str, Any]] = deque(maxlen=NUM_EVENTS_KEPT)

    def report(self, report: GatewayReport, now: float) -> Order | None:
        """Take a gateway's report; the order for it to apply, if it leads and one waits."""
        gateway = report.gateway_id
        if self.leader is None or now - self.leader_at > self.stale_s:
            if self.leader != gateway:
                logger.info("autoscaler: gateway %s leads (was %s)", gateway, self.leader)
            self.leader = gateway
        if gateway == self.leader:
            self.leader_at = now
        self.heard[gateway] = _Heard(report, now)
        if report.store is not None:
            self.stores[report.store] = _Heard(report, now)
        self.num_finished += report.num_finished
        self.num_met += report.num_met
        self.batch_tokens += report.batch_tokens_generated
        self.total_batch_tokens += report.batch_output_tokens
        self.total_batch_finished += report.num_batch_finished
        if self.window_start is None:
            self.window_start = now
        elif now - self.window_start >= self.config.window_s:
            self._close(now)
        if gateway == self.leader and self.pending is not None:
            order, self.pending = self.pending, None
            return order
        return None

    def manual(self, gateway_id: str, num_replicas: int, now: float) -> None:
        """A scale by hand on `gateway_id`, which applies it and leads from now on."""
        low, high = self.config.min_replicas, self.config.max_replicas
        if not low <= num_replicas <= high:
            raise InvalidRequestError(
                f"replicas: the autoscaler keeps the fleet within {low} to {high} "
                f"(--autoscale {low}:{high}), got {num_replicas}",
                param="replicas",
            )
        self.pending = None
        self.leader, self.leader_at = gateway_id, now
        self.policy.state = AutoscalerState(calm_windows=0, last_change_s=now)
        self.on_target(num_replicas)
        event = {"at": self.wall_clock(), "target": num_replicas, "reason": "manual"}
        self.events.append({**event, "gateway": gateway_id})

    def window(self, now: float) -> FleetWindow:
        """The window closing now, from the reports since the previous one."""
        fresh = [h.report for h in self.heard.values() if now - h.at <= self.stale_s]
        # The leader's counts: it applies the orders. (One that has not reported yet, having
        # just scaled by hand: the latest report's.)
        latest = max(self.heard.values(), key=lambda h: h.at, default=None)
        heard = self.heard.get(self.leader or "", latest)
        lead = heard.report if heard is not None else None
        num_replicas = lead.num_replicas if lead is not None else 0
        num_starting = lead.num_starting if lead is not None else 0
        stores = self._stores(now)
        per_request = self.total_batch_tokens / max(self.total_batch_finished, 1)
        pending = sum(r.num_batch_pending for r in stores)
        queued = sum(r.num_batch_queued for r in stores)
        deadlines = [r.batch_deadline_s for r in stores if r.batch_deadline_s is not None]
        ready = num_replicas - num_starting
        start = self.window_start if self.window_start is not None else now
        rate = self.batch_meter.rate(start, now, self.batch_tokens, queued, ready)
        return FleetWindow(
            now_s=now,
            num_replicas=num_replicas,
            num_starting=min(num_starting, num_replicas),
            slo_attainment=self.num_met / self.num_finished if self.num_finished else None,
            queued_prefill_tokens=sum(r.queued_prefill_tokens for r in fresh),
            batch_tokens_left=math.ceil(pending * per_request),
            batch_time_left_s=min(deadlines, default=0.0),
            batch_tokens_per_replica_s=rate,
        )

    def _stores(self, now: float) -> list[GatewayReport]:
        """The latest report of each batch store heard from lately (one a store)."""
        return [h.report for h in self.stores.values() if now - h.at <= self.stale_s]

    def _close(self, now: float) -> None:
        window = self.window(now)
        target = self.policy.decide(window)
        decision = self.policy.history[-1]
        self.events.append(
            {
                "at": self.wall_clock(),
                "replicas": window.num_replicas,
                "starting": window.num_starting,
                "target": target,
                "reason": decision.reason,
                "slo_attainment": window.slo_attainment,
                "num_finished": self.num_finished,
                "queued_prefill_tokens": window.queued_prefill_tokens,
                "batch_tokens_left": window.batch_tokens_left,
            }
        )
        self.window_start = now
        ready = window.num_replicas - window.num_starting
        queued = sum(r.num_batch_queued for r in self._stores(now))
        self.batch_meter.closed(now, queued, ready)
        self.num_finished = self.num_met = self.batch_tokens = 0
        if target != window.num_replicas:
            self.seq += 1
            self.pending = Order(self.seq, target, decision.reason)
            self.on_target(target)

    def describe(self, now: float) -> dict[str, Any]:
        """The autoscaler part of GET /admin/fleet."""
        return {
            "min_replicas": self.config.min_replicas,
            "max_replicas": self.config.max_replicas,
            "window_s": self.config.window_s,
            "leader": self.leader,
            "gateways": sorted(g for g, h in self.heard.items() if now - h.at <= self.stale_s),
            "pending": dataclasses.asdict(self.pending) if self.pending is not None else None,
            "decisions": list(self.events),
        }


class AutoscalerActor:
    """The Ray actor around FleetAutoscaler (plain data in and out). On a cluster with an
    autoscaler of Ray's own, each target becomes a resource request of one bundle a
    replica (what placement.RayFleet asks for one), so that machines come for them."""

    def __init__(self, config: dict[str, Any], bundle: dict[str, float]) -> None:
        self.bundle = bundle
        self.state = FleetAutoscaler(AutoscalerConfig(**config), on_target=self._request)
        self.requested: int | None = None  # replicas' bundles last asked of Ray
        self.request_error: str | None = None

    def _request(self, target: int) -> None:
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[dict(self.bundle) for _ in range(target)])
            self.requested, self.request_error = target, None
        except Exception as exc:  # a cluster without the autoscaler's support: scaling goes on
            logger.exception("request_resources for %d replicas failed", target)
            self.request_error = f"{type(exc).__name__}: {exc}"

    def config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.state.config)

    def report(self, report: dict[str, Any]) -> dict[str, Any] | None:
        order = self.state.report(GatewayReport(**report), time.monotonic())
        return dataclasses.asdict(order) if order is not None else None

    def manual(self, gateway_id: str, num_replicas: int) -> str | None:
        """None, or why not (the message of a 400)."""
        try:
            self.state.manual(gateway_id, num_replicas, time.monotonic())
        except InvalidRequestError as exc:
            return exc.message
        return None

    def describe(self) -> dict[str, Any]:
        found = self.state.describe(time.monotonic())
        found["resources"] = {
            "bundle": self.bundle,
            "requested": self.requested,
            "error": self.request_error,
        }
        return found


class AutoscalerHandle(Protocol):
    """How a gateway calls the autoscaler (blocking: from a thread): Ray's named actor, or
    a FleetAutoscaler in this process in tests."""

    def report(self, report: GatewayReport) -> Order | None: ...

    def manual(self, gateway_id: str, num_replicas: int) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class LocalAutoscaler:
    """A FleetAutoscaler called in this process (tests; one gateway without Ray's name)."""

    def __init__(self, state: FleetAutoscaler, clock: Callable[[], float] = time.monotonic):
        self.state = state
        self.clock = clock

    def report(self, report: GatewayReport) -> Order | None:
        return self.state.report(report, self.clock())

    def manual(self, gateway_id: str, num_replicas: int) -> None:
        self.state.manual(gateway_id, num_replicas, self.clock())

    def describe(self) -> dict[str, Any]:
        return self.state.describe(self.clock())


class RayAutoscaler:
    """The named actor, found or created (get_if_exists) at each call after a failure."""

    def __init__(self, config: AutoscalerConfig, bundle: dict[str, float], namespace: str):
        self.config = config
        self.bundle = bundle
        self.namespace = namespace
        self._handle: Any = None

    def _actor(self) -> Any:
        if self._handle is None:
            import ray

            actor = ray.remote(AutoscalerActor).options(
                name=AUTOSCALER_NAME,
                namespace=self.namespace,
                lifetime="detached",
                get_if_exists=True,
                max_restarts=0,
                num_cpus=0,
            )
            self._handle = actor.remote(dataclasses.asdict(self.config), self.bundle)
            theirs = self._call(self._handle.config)
            if theirs != dataclasses.asdict(self.config):
                logger.warning("the fleet's autoscaler runs with other settings: %s", theirs)
        return self._handle

    def _call(self, method: Any, *args: Any) -> Any:
        import ray

        try:
            return ray.get(method.remote(*args), timeout=CALL_S)
        except ray.exceptions.RayActorError:
            self._handle = None  # dead: the next call creates it again
            raise

    def report(self, report: GatewayReport) -> Order | None:
        found = self._call(self._actor().report, dataclasses.asdict(report))
        return Order(**found) if found is not None else None

    def manual(self, gateway_id: str, num_replicas: int) -> None:
        why = self._call(self._actor().manual, gateway_id, num_replicas)
        if why is not None:
            raise InvalidRequestError(why, param="replicas")

    def describe(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call(self._actor().describe)
        return result


class GatewayAutoscaling:
    """A gateway's side: reports every `report_s`, applies the orders it gets through its
    FleetClient's Scaler, forwards scales by hand. `gather` makes this gateway's report
    (server/autoscale.py: its counters, its router, its batch store)."""

    def __init__(
        self,
        client: FleetClient,
        handle: AutoscalerHandle,
        gather: Callable[[], Awaitable[GatewayReport]],
        report_s: float,
    ) -> None:
        self.client = client
        self.handle = handle
        self.gather = gather
        self.report_s = report_s
        self.num_orders = 0
        self.last_order: Order | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self.round()
            except Exception:  # the actor gone or slow: the next round tries again
                logger.warning("the fleet's autoscaler could not be reached", exc_info=True)
            await asyncio.sleep(self.report_s)

    async def round(self) -> Order | None:
        """One report; the order it brought back, applied here."""
        report = await self.gather()
        order = await asyncio.to_thread(self.handle.report, report)
        if order is not None:
            self.apply(order)
        return order

    def apply(self, order: Order) -> None:
        logger.info("autoscaler order %d: %d replicas (%s)", order.seq, order.target, order.reason)
        self.num_orders += 1
        self.last_order = order
        self.client.scale(order.target)

    async def manual(self, num_replicas: int) -> dict[str, object]:
        """A scale by hand here: the autoscaler records it (or refuses: out of bounds),
        then this gateway scales."""
        await asyncio.to_thread(self.handle.manual, self.client.gateway_id, num_replicas)
        return self.client.scale(num_replicas)

    async def describe(self) -> dict[str, Any]:
        try:
            found = await asyncio.to_thread(self.handle.describe)
        except Exception as exc:
            found = {"error": f"the autoscaler could not be reached: {type(exc).__name__}"}
        found["orders_applied_here"] = self.num_orders
        return found


def fleet_autoscaling(
    client: FleetClient, fleet: FleetConfig, gather: Callable[[], Awaitable[GatewayReport]]
) -> GatewayAutoscaling:
    """The gateway's side of the fleet's autoscaler on Ray (after the client started: Ray
    is joined). One bundle a replica, as placement.RayFleet asks for one."""
    from tokenfleet.cluster.placement import NAMESPACE, REPLICA_RESOURCE

    config = autoscaler_config(fleet)
    gpus = bool(getattr(client.directory, "gpus", False))
    bundle = {"GPU": 1.0} if gpus else {REPLICA_RESOURCE: 1.0}
    handle = RayAutoscaler(config, bundle, NAMESPACE)
    return GatewayAutoscaling(client, handle, gather, report_interval(config))
