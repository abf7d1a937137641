"""This gateway's part of the fleet autoscaler's window (cluster/autoscaling.py): where each
FleetWindow field comes from, as this gateway sees it.

    num_finished, num_met     WindowCounts, told by GenerationService as each interactive
                              request ends: met = TTFT <= --ttft-target and its mean time
                              per output token <= --tpot-target
    batch_tokens_generated    WindowCounts, as each batch request's tokens reach this
                              gateway (the batch rate)
    batch_output_tokens,      WindowCounts, as each batch request ends here (the mean
      num_batch_finished      output of a batch request, for the backlog's tokens)
    queued_prefill_tokens     the FleetClient's router: prompt tokens this gateway routed
                              that the replica has not prefilled yet
    num_replicas, starting    the FleetClient's links (Scaler.size: starting or ready)
    store, batch pending,     the batch store: requests queued or leased, those queued,
      queued, deadline        and the earliest deadline among them (one SQL aggregate,
                              off the event loop)
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from tokenfleet.batch.schema import batch_requests
from tokenfleet.batch.store import BatchStore
from tokenfleet.cluster.autoscaling import GatewayReport

if TYPE_CHECKING:
    from tokenfleet.cluster.client import FleetClient


class WindowCounts:
    """Requests ended at this gateway since the last `take`."""

    def __init__(self, ttft_target_s: float, tpot_target_s: float) -> None:
        self.ttft_target_s = ttft_target_s
        self.tpot_target_s = tpot_target_s
        self.num_finished = self.num_met = 0
        self.batch_output_tokens = self.num_batch_finished = 0
        self.batch_tokens_generated = 0  # added to by GenerationService as tokens arrive

    def finished(self, interactive: bool, ttft_s: float, e2e_s: float, num_output: int) -> None:
        """One request ended with its last token: `ttft_s` and `e2e_s` from its arrival."""
        if not interactive:
            self.num_batch_finished += 1
            self.batch_output_tokens += num_output
            return
        tpot_s = (e2e_s - ttft_s) / (num_output - 1) if num_output > 1 else 0.0
        self.num_finished += 1
        self.num_met += ttft_s <= self.ttft_target_s and tpot_s <= self.tpot_target_s

    def take(self) -> tuple[int, int, int, int, int]:
        """(finished, met, batch output tokens of those ended, batch ended, batch tokens
        generated) since the last take."""
        taken = (
            self.num_finished,
            self.num_met,
            self.batch_output_tokens,
            self.num_batch_finished,
            self.batch_tokens_generated,
        )
        self.num_finished = self.num_met = self.batch_output_tokens = self.num_batch_finished = 0
        self.batch_tokens_generated = 0
        return taken


def batch_backlog(store: BatchStore, now: float) -> tuple[int, int, float | None]:
    """Batch requests not done (queued or leased), those of them queued (not leased yet),
    and seconds to their earliest deadline."""
    r = batch_requests.c
    queued = func.count().filter(r.status == "queued")
    query = select(func.count(), queued, func.min(r.deadline)).where(
        r.status.in_(("queued", "leased"))
    )
    with store.engine.connect() as conn:
        count, num_queued, deadline = conn.execute(query).one()
    left_s = None if deadline is None else max(0.0, float(deadline) - now)
    return int(count), int(num_queued), left_s


class GatewayWindow:
    """Makes this gateway's GatewayReport (GatewayAutoscaling's `gather`)."""

    def __init__(self, client: FleetClient, counts: WindowCounts, store: BatchStore) -> None:
        self.client = client
        self.counts = counts
        self.store = store
        self.store_id = store.engine.url.render_as_string(hide_password=True)

    async def __call__(self) -> GatewayReport:
        pending, queued, deadline_s = await asyncio.to_thread(
            batch_backlog, self.store, time.time()
        )
        finished, met, batch_tokens, batch_finished, generated = self.counts.take()
        links = self.client.links.values()
        return GatewayReport(
            gateway_id=self.client.gateway_id,
            num_replicas=self.client.scaler.size(),
            num_starting=sum(link.state == "starting" for link in links),
            num_finished=finished,
            num_met=met,
            queued_prefill_tokens=self.client.router.queued_prefill_tokens,
            batch_output_tokens=batch_tokens,
            num_batch_finished=batch_finished,
            batch_tokens_generated=generated,
            store=self.store_id,
            num_batch_pending=pending,
            num_batch_queued=queued,
            batch_deadline_s=deadline_s,
        )
