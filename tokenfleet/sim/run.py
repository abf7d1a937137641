"""Runs a SimConfig: the cost model, the workload, one Simulation per fleet policy.

Every policy sees the same arrivals and jobs (made from the same seed, or the same
trace), so their results differ by the policy alone. With `sample_replicas` a policy runs
as a sample of its replicas given that share of the traffic (sampling.py).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate

from tokenfleet.fleet.autoscaler import ScaleDecision
from tokenfleet.policy.harvest import StepCost
from tokenfleet.policy.step_model import LinearStepCost
from tokenfleet.sim.config import SimConfig
from tokenfleet.sim.cost_model import RooflineCost, load_coefficients, profile_step_model
from tokenfleet.sim.dispatch import JobState
from tokenfleet.sim.fleet import JobSubmission, SimSettings, Simulation
from tokenfleet.sim.metrics import Metrics
from tokenfleet.sim.pool import FleetPolicy
from tokenfleet.sim.sampling import Sampling
from tokenfleet.sim.trace import read_trace
from tokenfleet.sim.workload import INTERACTIVE, Arrival, batch_requests, interactive_arrivals


@dataclass
class PolicyResult:
    policy: FleetPolicy
    metrics: Metrics
    jobs: list[JobState]
    wall_s: float
    # Each autoscaled pool's decisions, by pool name, window by window.
    decisions: dict[str, list[ScaleDecision]] = field(default_factory=dict)
    # The sample run for `policy` (metrics and jobs are the sample's), None when in full.
    sampling: Sampling | None = None


def cost_models(config: SimConfig) -> tuple[StepCost, StepCost]:
    """(what steps take, what the replicas' schedulers believe they take: the engine's
    step-time model fitted on a start-up profile, its coefficients priced in plain
    Python, which is several times quicker than numpy's for one step)."""
    cost: StepCost
    if config.coefficients is not None:
        cost = load_coefficients(config.coefficients)
    else:
        cost = RooflineCost(config.deployment)
    sched = config.replica.scheduler
    model = profile_step_model(
        cost, sched.max_num_batched_tokens, sched.max_num_seqs, sched.max_model_len
    )
    return cost, LinearStepCost.from_dict(model.coefficients)


def interactive_stream(config: SimConfig, sampling: Sampling | None = None) -> Iterator[Arrival]:
    """The interactive arrivals, or the sample's share of them."""
    if config.trace is not None:
        arrivals = (a for a, _ in read_trace(config.trace) if a.kind == INTERACTIVE)
        return arrivals if sampling is None else sampling.thin(arrivals, config.seed)
    workload = config.interactive if sampling is None else sampling.interactive(config.interactive)
    return interactive_arrivals(workload, config.duration_s, config.seed)


def job_submissions(config: SimConfig, sampling: Sampling | None = None) -> list[JobSubmission]:
    """The batch jobs, or the sample's share of each one's requests."""
    if config.trace is not None:
        return _trace_jobs(config, sampling)
    jobs = [job if sampling is None else sampling.job(job) for job in config.batch_jobs]
    sizes = [job.num_requests for job in jobs]
    firsts = [0, *accumulate(sizes)]
    return [
        JobSubmission(
            i,
            job.submit_s,
            job.deadline_s,
            job.num_requests,
            job.lengths.output_median,
            partial(batch_requests, job, i, firsts[i], config.seed),
        )
        for i, job in enumerate(jobs)
    ]


def _trace_jobs(config: SimConfig, sampling: Sampling | None) -> list[JobSubmission]:
    """The trace's batch lines, one job per `job` value, submitted at its first line (a
    sample: the first of each job's lines, its share of them)."""
    assert config.trace is not None
    jobs: dict[int, list[Arrival]] = {}
    deadlines: dict[int, float] = {}
    for arrival, deadline_s in read_trace(config.trace):
        if arrival.kind != INTERACTIVE:
            jobs.setdefault(arrival.job_id, []).append(arrival)
            deadlines.setdefault(arrival.job_id, deadline_s or 0.0)
    if sampling is not None:
        jobs = {j: requests[: sampling.job_requests(len(requests))] for j, requests in jobs.items()}
    return [
        JobSubmission(
            job_id,
            requests[0].arrival_s,
            deadlines[job_id],
            len(requests),
            round(statistics.median(a.output_len for a in requests)),
            partial(iter, requests),
        )
        for job_id, requests in jobs.items()
    ]


@contextmanager
def _few_collections() -> Iterator[None]:
    """Collect young objects every 50,000 allocations instead of 700 while a simulation runs:
    its requests, steps and events are short-lived and free no cycles, so the default's
    collections were ~14 % of its CPU time (the threshold is restored after)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(50_000, thresholds[1], thresholds[2])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def simulate(
    config: SimConfig, policy: FleetPolicy, progress: Callable[[float], None] | None = None
) -> PolicyResult:
    """Run `policy` over the config's traffic (a sample of it with `sample_replicas`)."""
    cost, model = cost_models(config)
    settings = SimSettings(
        replica=config.replica,
        duration_s=config.duration_s,
        targets=config.targets,
        router=config.router,
        tensor_parallel=config.deployment.tensor_parallel,
        sample_s=config.sample_s,
    )
    sampling = config.sampling(policy)
    sim = Simulation(
        policy if sampling is None else sampling.policy(policy),
        settings,
        cost,
        model,
        interactive_stream(config, sampling),
        job_submissions(config, sampling),
    )
    began = time.perf_counter()
    with _few_collections():
        metrics = sim.run(progress)
    wall_s = time.perf_counter() - began
    decisions = {p.spec.name: list(p.scaler.history) for p in sim.pools if p.scaler is not None}
    return PolicyResult(policy, metrics, sim.jobs, wall_s, decisions, sampling)
