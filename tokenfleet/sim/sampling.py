"""Sampled fleets: N replicas simulated as k of them given k/N of the traffic.

The router balances, so each replica of a fleet sees the same demand whatever the fleet's
size; k replicas given k/N of the traffic see the demand each of the N would. What is
scaled, with f = k/N:

    replicas      each pool's count times f (a whole number >= 1, or the sample is refused)
    interactive   generated: a Poisson process at f times the rate (what thinning each
                  arrival with probability f gives, in law, at f of the cost: a day of a
                  1,000-replica fleet is ~1e9 arrivals); a trace: each interactive line
                  kept with probability f, drawn from the seed's own stream
    batch jobs    f of each job's requests (rounded, at least 1): its first ones, same
                  submit time and deadline
    results       totals (replica-hours, requests, tokens, replicas over time, a job's
                  requests) times N/k; per-request distributions (TTFT/TPOT percentiles,
                  SLO attainment) and ratios (tokens per accelerator-hour) as they are

k = N changes nothing: the same arrivals, jobs and results as the full simulation. What
does not carry over from k to N: effects of the fleet's size itself (prefix affinity
across hundreds of replicas, the router's imbalance over more candidates). The
autoscaler's steps (down by one, up by at least one) do not scale, so a sample with an
autoscaler is refused.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from tokenfleet.sim.pool import FleetPolicy
from tokenfleet.sim.workload import Arrival, BatchJob, InteractiveWorkload


@dataclass(frozen=True)
class Sampling:
    """k (`num_simulated`) replicas standing for a fleet of N (`num_replicas`)."""

    num_simulated: int
    num_replicas: int

    def __post_init__(self) -> None:
        if self.num_simulated < 1:
            raise ValueError(f"sample_replicas must be >= 1, got {self.num_simulated}")
        if self.num_simulated > self.num_replicas:
            raise ValueError(
                f"sample_replicas ({self.num_simulated}) must be at most the fleet's "
                f"replicas ({self.num_replicas})"
            )

    @property
    def fraction(self) -> float:
        """f = k/N: the share of the traffic the sample is given."""
        return self.num_simulated / self.num_replicas

    @property
    def scale(self) -> float:
        """N/k: what a total of the sample is multiplied by to stand for the fleet."""
        return self.num_replicas / self.num_simulated

    @property
    def full(self) -> bool:
        return self.num_simulated == self.num_replicas

    def policy(self, policy: FleetPolicy) -> FleetPolicy:
        """The policy's pools with f of their replicas each."""
        if self.full:
            return policy
        pools = []
        for pool in policy.pools:
            if pool.autoscaler is not None:
                raise ValueError(
                    f"pool {pool.name!r} is autoscaled: its steps (down by one, up by at "
                    "least one) do not scale to a sample; simulate it in full"
                )
            num, rest = divmod(pool.replicas * self.num_simulated, self.num_replicas)
            if rest or num < 1:
                raise ValueError(
                    f"pool {pool.name!r}: {pool.replicas} replicas x "
                    f"{self.num_simulated}/{self.num_replicas} is not a whole number >= 1; "
                    "pick sample_replicas so that every pool scales exactly"
                )
            pools.append(replace(pool, replicas=num))
        return replace(policy, pools=tuple(pools))

    def interactive(self, workload: InteractiveWorkload) -> InteractiveWorkload:
        if self.full:
            return workload
        return replace(workload, peak_rate=workload.peak_rate * self.fraction)

    def job(self, job: BatchJob) -> BatchJob:
        return replace(job, num_requests=self.job_requests(job.num_requests))

    def job_requests(self, num_requests: int) -> int:
        if self.full:
            return num_requests
        return max(1, round(num_requests * self.fraction))

    def thin(self, arrivals: Iterable[Arrival], seed: int) -> Iterator[Arrival]:
        """Each arrival kept with probability f, decided by a stream of the seed's own."""
        if self.full:
            yield from arrivals
            return
        rng = random.Random(f"{seed}:sample-replicas")
        f = self.fraction
        for arrival in arrivals:
            if rng.random() < f:
                yield arrival

    def total(self, value: float) -> float:
        """A total of the sample, standing for the fleet."""
        return value if self.full else value * self.scale
