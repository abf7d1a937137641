"""The fleet autoscaler's bookkeeping (cluster/autoscaling.py) without Ray: the window it
gathers from several gateways' reports, orders handed to the leader alone and applied
once, a scale by hand recorded, and each gateway's own counts (server/autoscale.py). The
gateways' FleetClients are stand-ins that record the scales asked of them; the real
thing is tests/cluster/test_fleet_autoscale.py."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tokenfleet.batch.store import BatchStore
from tokenfleet.cluster.autoscaling import (
    FleetAutoscaler,
    GatewayAutoscaling,
    GatewayReport,
    LocalAutoscaler,
    Order,
)
from tokenfleet.errors import InvalidRequestError
from tokenfleet.fleet.autoscaler import AutoscalerConfig
from tokenfleet.server.autoscale import WindowCounts, batch_backlog

pytestmark = pytest.mark.fake("fleet client: a stand-in that records the scales asked of it")

CONFIG = AutoscalerConfig(
    min_replicas=1, max_replicas=4, window_s=10.0, down_windows=2, up_cooldown_s=0.0,
    down_cooldown_s=0.0,
)  # fmt: skip


def report(gateway: str, **fields: object) -> GatewayReport:
    values: dict[str, object] = {"num_replicas": 2, "num_starting": 0, **fields}
    return GatewayReport(gateway, **values)  # type: ignore[arg-type]


def test_standin_gateways_window_sums_counts_once_and_levels_per_gateway_and_store() -> None:
    scaler = FleetAutoscaler(CONFIG, wall_clock=lambda: 0.0)
    scaler.report(report("a", num_finished=6, num_met=6, queued_prefill_tokens=100), 0.0)
    scaler.report(report("b", num_finished=4, num_met=1, queued_prefill_tokens=50), 1.0)
    # A later report of a: its counts add up, its level replaces its previous one.
    scaler.report(report("a", num_finished=10, num_met=5, queued_prefill_tokens=300), 2.0)
    # Two gateways on one store report its backlog alike: counted once; a second store adds.
    shared = {"store": "postgresql://db", "num_batch_pending": 10, "batch_deadline_s": 500.0}
    a = report(
        "a", batch_output_tokens=800, num_batch_finished=8, queued_prefill_tokens=300, **shared
    )
    scaler.report(a, 3.0)
    b = report(
        "b", batch_output_tokens=200, num_batch_finished=2, queued_prefill_tokens=50, **shared
    )
    scaler.report(b, 4.0)
    own = {"store": "sqlite:///c", "num_batch_pending": 5, "batch_deadline_s": 300.0}
    scaler.report(report("c", **own), 5.0)
    window = scaler.window(8.0)
    assert window.num_replicas == 2 and window.num_starting == 0  # the leader's (a) counts
    assert window.slo_attainment == 12 / 20
    assert window.queued_prefill_tokens == 300 + 50 + 0  # each gateway's latest, summed
    assert window.batch_tokens_left == (10 + 5) * 100  # pending x tokens a request (1000/10)
    assert window.batch_time_left_s == 300.0
    assert window.batch_tokens_per_replica_s == 0.0  # the backlog's first window: unmeasured


def test_standin_gateways_batch_rate_counts_tokens_generated_over_fed_settled_windows() -> None:
    """BatchRateMeter through the gateways' reports: tokens as generated, summed over the
    gateways; measured only over a window with batch requests queued at both ends and the
    ready replicas unchanged, `batch_settle_s` (a window here) after either began."""
    config = dataclasses.replace(CONFIG, batch_settle_s=10.0)
    scaler = FleetAutoscaler(config)  # windows of 10 s, closed by the report that ends one
    store = {"store": "sqlite:///s", "batch_deadline_s": 1000.0}
    job = {**store, "num_batch_pending": 50, "num_batch_queued": 30}
    rates: list[float] = []

    def window(at: float, *reports: GatewayReport) -> None:
        for r in reports:
            scaler.report(r, at - 1.0)
        rates.append(scaler.window(at).batch_tokens_per_replica_s)
        counts = {"batch_tokens_generated": 0, "num_batch_finished": 0, "batch_output_tokens": 0}
        scaler.report(dataclasses.replace(reports[0], **counts), at)  # levels alike: closes it

    scaler.report(report("a", **store), 0.0)  # the first window opens: no batch
    # A job arrives within it: tokens are generated, none of its requests has ended.
    window(10.0, report("a", batch_tokens_generated=400, **job))
    assert scaler.window(10.0).batch_tokens_left == 0  # no request has ended: no mean yet
    window(20.0, report("a", batch_tokens_generated=600, num_batch_finished=1,
                        batch_output_tokens=50, **job))  # fmt: skip
    # Fed since 10 s, settled from 20 s: the third window is measured, both gateways'.
    window(30.0, report("a", batch_tokens_generated=900, **job),
           report("b", batch_tokens_generated=300, **job))  # fmt: skip
    assert rates == [0.0, 0.0, (900 + 300) / 2 / 10.0]
    assert scaler.policy.history[1].reason == "hold"  # a backlog of 2,500 tokens, no rate
    # A replica more: unmeasured until it has settled too.
    window(40.0, report("a", batch_tokens_generated=800, num_replicas=3, **job))
    window(50.0, report("a", batch_tokens_generated=800, num_replicas=3, **job))
    window(60.0, report("a", batch_tokens_generated=1200, num_replicas=3, **job))
    assert rates[3:] == [0.0, 0.0, 1200 / 3 / 10.0]
    # The tail: every request is on a replica (none queued): more cannot make it sooner.
    tail = {**store, "num_batch_pending": 5, "num_batch_queued": 0}
    window(70.0, report("a", batch_tokens_generated=500, num_replicas=3, **tail))
    assert rates[-1] == 0.0


def test_standin_gateways_silent_gateway_left_out_and_leader_taken_over() -> None:
    scaler = FleetAutoscaler(CONFIG)  # reports every 2.5 s: stale after 10 s
    scaler.report(report("a", queued_prefill_tokens=100), 0.0)
    scaler.report(report("b", queued_prefill_tokens=7, num_replicas=3), 1.0)
    assert scaler.leader == "a"
    assert scaler.window(9.0).queued_prefill_tokens == 107
    assert scaler.window(10.5).queued_prefill_tokens == 7  # a silent for 10.5 s: out
    scaler.report(report("b", queued_prefill_tokens=7, num_replicas=3), 10.5)
    assert scaler.leader == "b"
    assert scaler.window(10.5).num_replicas == 3


def test_standin_gateways_order_goes_to_the_leader_once() -> None:
    scaler = FleetAutoscaler(CONFIG)
    assert scaler.report(report("a"), 0.0) is None
    assert scaler.report(report("b", num_finished=10, num_met=0), 5.0) is None
    assert scaler.report(report("a"), 8.0) is None
    # b closes the window (attainment 0: up by one) but does not lead: the order waits.
    assert scaler.report(report("b"), 10.0) is None
    assert scaler.pending == Order(1, 3, "slo")
    assert scaler.report(report("b"), 11.0) is None
    assert scaler.report(report("a"), 12.0) == Order(1, 3, "slo")
    assert scaler.report(report("a"), 13.0) is None  # handed out once
    decisions = [
        (e["replicas"], e["target"], e["reason"]) for e in scaler.describe(13.0)["decisions"]
    ]
    assert decisions == [(2, 3, "slo")]


def test_standin_gateways_manual_scale_counts_as_the_last_change_and_moves_the_leader() -> None:
    config = AutoscalerConfig(
        min_replicas=1, max_replicas=4, window_s=10.0, down_windows=1, up_cooldown_s=0.0,
        down_cooldown_s=25.0,
    )  # fmt: skip
    targets: list[int] = []
    scaler = FleetAutoscaler(config, on_target=targets.append, wall_clock=lambda: 0.0)
    scaler.report(report("a", num_replicas=3), 0.0)
    with pytest.raises(InvalidRequestError, match=r"within 1 to 4") as refused:
        scaler.manual("b", 5, 1.0)
    assert refused.value.param == "replicas"
    scaler.manual("b", 3, 1.0)
    assert scaler.leader == "b" and targets == [3]
    # Calm windows, but the down cool-down runs from the manual change at 1 s.
    assert scaler.report(report("b", num_replicas=3), 10.0) is None
    assert scaler.report(report("b", num_replicas=3), 20.0) is None
    assert scaler.report(report("b", num_replicas=3), 30.0) == Order(1, 2, "calm")
    assert targets == [3, 2]
    reasons = [e["reason"] for e in scaler.describe(30.0)["decisions"]]
    assert reasons == ["manual", "cooldown", "cooldown", "calm"]


def test_standin_gateways_manual_scale_drops_an_order_not_yet_taken() -> None:
    scaler = FleetAutoscaler(CONFIG)
    scaler.report(report("a"), 0.0)
    scaler.report(report("b", num_finished=5), 10.0)  # closes: 0 of 5 met, up
    assert scaler.pending is not None
    scaler.manual("b", 2, 10.5)
    assert scaler.pending is None
    assert scaler.report(report("a"), 11.0) is None


def test_standin_gateways_manual_scale_on_a_gateway_not_yet_heard_from_leads() -> None:
    scaler = FleetAutoscaler(CONFIG)
    scaler.report(report("a", num_replicas=1), 0.0)
    scaler.manual("b", 3, 0.5)
    # b's scale is not in a's count yet: the window takes the latest report until b's.
    assert scaler.window(1.0).num_replicas == 1
    scaler.report(report("a", num_replicas=1), 1.0)
    assert scaler.leader == "b"
    scaler.report(report("b", num_replicas=3, num_starting=2), 2.0)
    assert (scaler.window(3.0).num_replicas, scaler.window(3.0).num_starting) == (3, 2)


@dataclass
class StandInClient:
    gateway_id: str
    scaled: list[int] = field(default_factory=list)

    def scale(self, num_replicas: int) -> dict[str, object]:
        self.scaled.append(num_replicas)
        return {"replicas": num_replicas}


def test_standin_gateways_two_gateways_one_autoscaler_applied_once() -> None:
    now = [0.0]
    shared = LocalAutoscaler(FleetAutoscaler(CONFIG), clock=lambda: now[0])
    clients = [StandInClient("a"), StandInClient("b")]
    counts = {"a": 0, "b": 0}

    def gather(client: StandInClient):  # type: ignore[no-untyped-def]
        async def make() -> GatewayReport:
            size = client.scaled[-1] if client.scaled else 2
            finished, counts[client.gateway_id] = counts[client.gateway_id], 0
            return report(client.gateway_id, num_replicas=size, num_finished=finished)

        return make

    sides = [GatewayAutoscaling(c, shared, gather(c), 2.5) for c in clients]  # type: ignore[arg-type]

    async def rounds(n: int) -> None:
        for _ in range(n):
            for side in sides:
                await side.round()
            now[0] += 2.5

    counts["b"] = 10  # b's requests all missed their targets
    asyncio.run(rounds(5))
    assert clients[0].scaled == [3] and clients[1].scaled == []
    assert (sides[0].num_orders, sides[1].num_orders) == (1, 0)
    # By hand on b: recorded, applied by b alone, b leads from now on.
    asyncio.run(sides[1].manual(4))
    assert clients[1].scaled == [4] and clients[0].scaled == [3]
    assert shared.state.leader == "b"
    with pytest.raises(InvalidRequestError):
        asyncio.run(sides[0].manual(9))
    assert clients[0].scaled == [3]


def test_window_counts_met_by_ttft_and_mean_tpot() -> None:
    counts = WindowCounts(ttft_target_s=1.0, tpot_target_s=0.1)
    counts.finished(True, ttft_s=0.5, e2e_s=0.5 + 9 * 0.1, num_output=10)  # met, exactly
    counts.finished(True, ttft_s=1.5, e2e_s=1.6, num_output=2)  # TTFT over
    counts.finished(True, ttft_s=0.2, e2e_s=0.2 + 9 * 0.2, num_output=10)  # TPOT over
    counts.finished(True, ttft_s=0.3, e2e_s=0.3, num_output=1)  # one token: TTFT alone
    counts.finished(False, ttft_s=9.0, e2e_s=20.0, num_output=64)  # batch: its tokens
    counts.batch_tokens_generated += 70  # as GenerationService counts them, ended or not
    assert counts.take() == (4, 2, 64, 1, 70)
    assert counts.take() == (0, 0, 0, 0, 0)


@pytest.mark.fake("store: rows written straight into the table")
def test_batch_backlog_counts_queued_and_leased_and_earliest_deadline(tmp_path: Path) -> None:
    from sqlalchemy import insert

    from tokenfleet.batch.schema import batch_requests, batches

    store = BatchStore(f"sqlite:///{tmp_path / 'b.db'}")
    assert batch_backlog(store, 1000.0) == (0, 0, None)
    with store.engine.begin() as conn:
        conn.execute(
            insert(batches),
            [{"id": "b1", "api": "openai", "owner": "o", "endpoint": "/v1/chat/completions",
              "state": "in_progress", "num_requests": 4, "created_at": 0.0,
              "expires_at": 2000.0, "metadata": "{}"}],
        )  # fmt: skip
        rows = [
            ("queued", 2000.0), ("leased", 1500.0), ("succeeded", 1200.0), ("queued", 1800.0),
        ]  # fmt: skip
        conn.execute(
            insert(batch_requests),
            [{"batch_id": "b1", "idx": i, "custom_id": str(i), "params": "{}", "prefix_key": "",
              "status": status, "deadline": deadline, "submitted_at": 0.0, "attempts": 0,
              "lease_epoch": 0} for i, (status, deadline) in enumerate(rows)],
        )  # fmt: skip
    assert batch_backlog(store, 1000.0) == (3, 2, 500.0)  # pending, queued, deadline
    store.close()
