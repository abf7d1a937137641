"""The discrete-event loop: a fleet of simulated replicas on a virtual clock.

Events, in time order (ties: a step's end first, then arrivals, jobs, replicas coming up,
autoscaler ticks, samples; then the order they were made in, so a run is a function of
its inputs and seed alone):

    step end      the replica applies its step (or leap), the dispatcher leases it batch
                  work if it has room, and it schedules its next step
    arrival       the router picks a replica; one in a leap is cut back to a plain step
    job           a batch job joins the backlog; replicas with room lease from it
    replica up    an autoscaled replica starts serving
    tick          each autoscaled pool's policy is asked for its replica count
    sample        replicas (serving, starting, draining) and KV use per pool, interactive
                  requests and batch tokens done so far, for the report

A replica whose step-end event is superseded (a cut leap ends earlier) leaves the old one
in the heap; it is skipped by its version number.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Any

from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE, Request
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.fleet.autoscaler import FleetWindow
from tokenfleet.fleet.router import Router, RouterConfig
from tokenfleet.policy.harvest import StepCost
from tokenfleet.sim.dispatch import BatchBacklog, JobState, room
from tokenfleet.sim.metrics import InFlight, Metrics, Sample, Targets
from tokenfleet.sim.pool import FleetPolicy, Pool
from tokenfleet.sim.replica import ReplicaConfig, SimReplica, StepOutputs
from tokenfleet.sim.workload import BATCH, INTERACTIVE, Arrival, prompt_token_ids

STEP_END, ARRIVAL, JOB, REPLICA_UP, TICK, SAMPLE = range(6)


@dataclass(frozen=True)
class SimSettings:
    replica: ReplicaConfig
    duration_s: float
    targets: Targets = field(default_factory=Targets)
    router: RouterConfig = field(default_factory=RouterConfig)
    tensor_parallel: int = 1  # accelerators per replica, for accelerator-hours
    sample_s: float = 60.0
    queue_target: int | None = None  # the server's max(4, max_num_seqs // 8) when None

    @property
    def depth(self) -> int:
        return self.replica.scheduler.max_num_seqs

    @property
    def lease_queue_target(self) -> int:
        return self.queue_target if self.queue_target is not None else max(4, self.depth // 8)


@dataclass(frozen=True)
class JobSubmission:
    job_id: int
    submit_s: float
    deadline_s: float  # after submission
    num_requests: int
    output_median: int
    requests: Callable[[], Iterator[Arrival]]


class Simulation:
    def __init__(
        self,
        policy: FleetPolicy,
        settings: SimSettings,
        cost: StepCost,
        step_model: StepCost,
        interactive: Iterable[Arrival],
        jobs: Iterable[JobSubmission] = (),
    ) -> None:
        self.policy = policy
        self.settings = settings
        self.cost = cost
        self.step_model = step_model
        self.metrics = Metrics(settings.targets)
        self.backlog = BatchBacklog()
        self.now = 0.0
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = count()
        self._replica_ids = count()
        self._versions: dict[int, int] = {}
        self._pool_of: dict[int, Pool] = {}
        self._requests: dict[str, InFlight] = {}
        self._arrivals = iter(interactive)
        self._num_arrived = 0
        block_size = settings.replica.block_size
        self.pools = [Pool(i, spec) for i, spec in enumerate(policy.pools)]
        self.routers = {p.index: Router(settings.router, block_size) for p in self.pools}
        for pool in self.pools:
            for _ in range(pool.spec.replicas):
                self._add_replica(pool)
            if pool.spec.autoscaler is not None:
                self._push(pool.spec.autoscaler.window_s, TICK, pool)
        for job in jobs:
            self._push(job.submit_s, JOB, job)
        self._next_arrival()
        self._push(0.0, SAMPLE, None)

    # -- the loop ------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> Metrics:
        """Run to `duration_s`; `progress` is told the virtual time every so often."""
        handlers: dict[int, Callable[[Any], None]] = {
            STEP_END: self._on_step_end,
            ARRIVAL: self._on_arrival,
            JOB: self._on_job,
            REPLICA_UP: self._on_replica_up,
            TICK: self._on_tick,
            SAMPLE: self._on_sample,
        }
        duration = self.settings.duration_s
        while self._events and self._events[0][0] < duration:
            self.now, kind, _, data = heapq.heappop(self._events)
            handlers[kind](data)
            if progress is not None and kind == SAMPLE:
                progress(self.now)
        self.now = duration
        self._close()
        return self.metrics

    def _push(self, time: float, kind: int, data: Any) -> None:
        heapq.heappush(self._events, (time, kind, next(self._seq), data))

    # -- replicas ------------------------------------------------------------------

    def _add_replica(self, pool: Pool, asked_at: float = 0.0) -> None:
        replica_id = next(self._replica_ids)
        config = self.settings.replica
        if config.policy != pool.spec.policy:
            config = replace(config, policy=pool.spec.policy)
        pool.replicas[replica_id] = SimReplica(replica_id, config, self.cost, self.step_model)
        pool.serving.append(replica_id)
        pool.started_at[replica_id] = asked_at  # paid for from when it was asked for
        pool.batch_in_flight[replica_id] = 0
        self._pool_of[replica_id] = pool
        self._versions[replica_id] = 0
        self.routers[pool.index].add_replica(replica_id)
        self._dispatch(pool, replica_id)

    def _start(self, replica: SimReplica) -> None:
        """Begin the replica's next step, unless one is in flight."""
        if not replica.idle:
            return
        pool = self._pool_of[replica.replica_id]
        may_leap = not (self.backlog and self._room(pool, replica) > 0)
        end = replica.start_step(self.now, may_leap=may_leap)
        if end is not None:
            self._schedule_end(replica)

    def _schedule_end(self, replica: SimReplica) -> None:
        self._versions[replica.replica_id] += 1
        assert replica.busy_until is not None
        self._push(
            replica.busy_until, STEP_END, (replica.replica_id, self._versions[replica.replica_id])
        )

    def _touch(self, replica: SimReplica) -> None:
        """Make the replica's state that of `now` before it takes a request."""
        before = replica.busy_until
        self._deliver(replica.replica_id, replica.cut(self.now))
        if replica.busy_until != before:
            self._schedule_end(replica)

    def _on_step_end(self, data: tuple[int, int]) -> None:
        replica_id, version = data
        if self._versions.get(replica_id) != version:
            return  # superseded by a cut leap, or retired
        pool = self._pool_of[replica_id]
        replica = pool.replicas[replica_id]
        self._deliver(replica_id, replica.end_step())
        self._dispatch(pool, replica_id)
        if replica_id in pool.draining and not replica.scheduler.has_unfinished_requests():
            self._retire(pool, replica_id)
            return
        self._start(replica)

    def _deliver(self, replica_id: int, steps: list[StepOutputs]) -> None:
        pool = self._pool_of[replica_id]
        router = self.routers[pool.index]
        for time, outputs in steps:
            for output in outputs:
                request = self._requests[output.req_id]
                arrival = request.arrival
                if request.first_token_at is None:
                    request.first_token_at = time
                    if arrival.kind == INTERACTIVE:
                        router.prefilled(replica_id, request.routed_tokens)
                if output.finish_reason is None:
                    continue
                del self._requests[output.req_id]
                met = self.metrics.finish(request, time)
                if arrival.kind == INTERACTIVE:
                    router.finished(replica_id)
                    pool.window_finished += 1
                    pool.window_met += met
                else:
                    pool.batch_in_flight[replica_id] -= 1
                    pool.batch_tokens_done += arrival.output_len
                    job = self.backlog.jobs[arrival.job_id]
                    job.num_done += 1
                    job.num_done_in_time += time <= job.deadline_at
                    job.output_tokens_left -= arrival.output_len
                    job.last_done_at = time

    # -- work in -------------------------------------------------------------------

    def _next_arrival(self) -> None:
        arrival = next(self._arrivals, None)
        if arrival is not None:
            self._push(arrival.arrival_s, ARRIVAL, arrival)

    def _on_arrival(self, arrival: Arrival) -> None:
        self._next_arrival()
        self._num_arrived += 1
        pool = next((p for p in self.pools if p.spec.interactive and p.serving), None)
        if pool is None:
            self.metrics.classes[INTERACTIVE].num_refused += 1
            return
        prompt = prompt_token_ids(arrival)
        replica_id, num_tokens = self.routers[pool.index].route(prompt, pool.serving)
        self._admit(pool, replica_id, arrival, prompt, PRIORITY_INTERACTIVE)
        self._requests[arrival.req_id].routed_tokens = num_tokens
        self._start(pool.replicas[replica_id])

    def _admit(
        self, pool: Pool, replica_id: int, arrival: Arrival, prompt: list[int], priority: int
    ) -> None:
        replica = pool.replicas[replica_id]
        self._touch(replica)
        request = Request(
            arrival.req_id,
            prompt,
            SamplingParams(max_tokens=arrival.output_len, ignore_eos=True),
            arrival_time=self.now,
            priority=priority,
        )
        replica.add_request(request)
        self._requests[arrival.req_id] = InFlight(arrival, pool.index, replica_id)

    def _on_job(self, job: JobSubmission) -> None:
        self.backlog.submit(
            JobState(
                job.job_id,
                job.submit_s,
                job.submit_s + job.deadline_s,
                job.num_requests,
                job.output_median,
                job.requests(),
            )
        )
        for pool in self.pools:
            for replica_id in list(pool.serving):
                self._dispatch(pool, replica_id)

    def _room(self, pool: Pool, replica: SimReplica) -> int:
        if not pool.spec.batch or replica.replica_id not in pool.serving:
            return 0
        sched = replica.scheduler
        in_flight = pool.batch_in_flight[replica.replica_id]
        waiting = sum(1 for r in sched.waiting if r.req_id.startswith("b-"))
        return room(
            in_flight,
            in_flight - waiting,
            waiting,
            queue_target=self.settings.lease_queue_target,
            depth=self.settings.depth,
        )

    def _dispatch(self, pool: Pool, replica_id: int) -> None:
        """Lease the replica what the dispatcher's rule gives it room for."""
        if not self.backlog:
            return
        replica = pool.replicas[replica_id]
        num = self._room(pool, replica)
        for arrival in self.backlog.take(num) if num > 0 else ():
            job = self.backlog.jobs[arrival.job_id]
            job.output_tokens_left += arrival.output_len
            job.leased_output_tokens += arrival.output_len
            pool.batch_in_flight[replica_id] += 1
            self._admit(pool, replica_id, arrival, prompt_token_ids(arrival), PRIORITY_BATCH)
        self._start(replica)

    # -- scaling -------------------------------------------------------------------

    def _on_tick(self, pool: Pool) -> None:
        scaler = pool.scaler
        assert scaler is not None
        config = scaler.config
        self._push(self.now + config.window_s, TICK, pool)
        jobs = self.backlog.jobs.values() if pool.spec.batch else ()
        pending = [j for j in jobs if not j.done]
        queued = self.backlog.num_unleased if pool.spec.batch else 0
        attainment, batch_rate = pool.take_window(self.now, queued)
        window = FleetWindow(
            now_s=self.now,
            num_replicas=pool.size,
            num_starting=pool.num_starting,
            slo_attainment=attainment,
            queued_prefill_tokens=self.routers[pool.index].queued_prefill_tokens,
            batch_tokens_left=sum(_tokens_left(j) for j in pending),
            batch_time_left_s=min((j.deadline_at - self.now for j in pending), default=0.0),
            # As they were generated, by the replicas up (serving or draining, not starting);
            # 0 where not measured (BatchRateMeter).
            batch_tokens_per_replica_s=batch_rate,
        )
        target = scaler.decide(window)
        for _ in range(target - pool.size):
            pool.num_starting += 1
            self._push(self.now + config.startup_s, REPLICA_UP, (pool, self.now))
        for _ in range(pool.size - target):
            if len(pool.serving) > 1:
                self._drain(pool, pool.serving[-1])

    def _on_replica_up(self, data: tuple[Pool, float]) -> None:
        pool, asked_at = data
        pool.num_starting -= 1
        self._add_replica(pool, asked_at)

    def _drain(self, pool: Pool, replica_id: int) -> None:
        pool.serving.remove(replica_id)
        pool.draining.add(replica_id)
        self.routers[pool.index].remove_replica(replica_id)
        if pool.replicas[replica_id].idle:
            self._retire(pool, replica_id)

    def _retire(self, pool: Pool, replica_id: int) -> None:
        pool.draining.discard(replica_id)
        replica = pool.replicas.pop(replica_id)
        self._count_steps(replica)
        self._versions.pop(replica_id)
        self.metrics.accelerator_s += self._accelerator_s(pool.started_at.pop(replica_id))

    def _accelerator_s(self, started_at: float) -> float:
        return (self.now - started_at) * self.settings.tensor_parallel

    def _count_steps(self, replica: SimReplica) -> None:
        self.metrics.num_steps += replica.scheduler.num_steps
        self.metrics.num_leap_steps += replica.num_leap_steps

    # -- observing -----------------------------------------------------------------

    def _on_sample(self, _: None) -> None:
        self._push(self.now + self.settings.sample_s, SAMPLE, None)
        pools, log = self.pools, self.metrics.classes[INTERACTIVE]
        sample = Sample(
            self.now,
            [len(p.replicas) for p in pools],
            [p.kv_usage(self.now) for p in pools],
            [p.num_starting for p in pools],
            [len(p.draining) for p in pools],
            self._num_arrived,
            log.num_finished,
            log.num_refused,
            log.num_met,
            {j.job_id: j.leased_output_tokens - j.output_tokens_left for j in self.jobs},
        )
        self.metrics.samples.append(sample)

    def _close(self) -> None:
        """Count what the run left unfinished: accelerator time to the end, and the
        tokens of requests still running (their leaps applied up to now first)."""
        for pool in self.pools:
            for replica_id, replica in pool.replicas.items():
                if replica.busy_until is not None and replica.busy_until > self.now:
                    self._deliver(replica_id, replica.cut(self.now))
                self._count_steps(replica)
                self.metrics.accelerator_s += self._accelerator_s(pool.started_at[replica_id])
        for req_id, request in self._requests.items():
            log = self.metrics.classes[request.arrival.kind]
            log.num_unfinished += request.arrival.kind == INTERACTIVE
            holder = self.pools[request.pool].replicas.get(request.replica_id)
            state = None if holder is None else holder.scheduler.requests.get(req_id)
            if state is not None:
                log.unfinished_output_tokens += state.num_output_tokens
        self.metrics.classes[BATCH].num_unfinished = sum(
            j.num_requests - j.num_done for j in self.backlog.jobs.values()
        )

    @property
    def jobs(self) -> list[JobState]:
        return list(self.backlog.jobs.values())


def _tokens_left(job: JobState) -> int:
    """Output tokens the job still owes: its leased requests' left, and its unleased ones
    at the mean of those leased so far (the job's median before any)."""
    unleased = job.num_requests - job.num_leased
    mean = job.leased_output_tokens / job.num_leased if job.num_leased else job.output_median
    return round(job.output_tokens_left + unleased * mean)
