"""Batch work in the simulated fleet: the backlog of accepted jobs and the leasing.

The backlog hands out requests earliest deadline first (a job's requests in order, each
made only when leased, so a 100,000-request job costs nothing until it runs). How many a
replica gets is the gateway's own rule, `lease_room` from fleet/leasing.py: enough to keep
`queue_target` batch requests waiting in the engine beyond those it runs, never over
`depth` in flight. Leases happen when a job arrives and when a replica ends a step, as the
dispatcher looks again whenever a slot may have freed.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenfleet.fleet.leasing import lease_room
from tokenfleet.sim.workload import Arrival


@dataclass
class JobState:
    job_id: int
    submit_s: float
    deadline_at: float
    num_requests: int
    output_median: int
    requests: Iterator[Arrival]
    num_leased: int = 0
    leased_output_tokens: int = 0
    num_done: int = 0
    num_done_in_time: int = 0  # by deadline_at
    output_tokens_left: int = 0  # of the leased requests not yet done
    last_done_at: float | None = None

    @property
    def done(self) -> bool:
        return self.num_done == self.num_requests


@dataclass
class BatchBacklog:
    """Jobs with requests not yet leased, earliest deadline first."""

    jobs: dict[int, JobState] = field(default_factory=dict)
    _pending: list[tuple[float, int]] = field(default_factory=list)  # (deadline, job_id)

    def submit(self, job: JobState) -> None:
        self.jobs[job.job_id] = job
        heapq.heappush(self._pending, (job.deadline_at, job.job_id))

    @property
    def num_unleased(self) -> int:
        return sum(self.jobs[j].num_requests - self.jobs[j].num_leased for _, j in self._pending)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def take(self, count: int) -> list[Arrival]:
        taken: list[Arrival] = []
        while self._pending and len(taken) < count:
            job = self.jobs[self._pending[0][1]]
            for arrival in job.requests:
                taken.append(arrival)
                job.num_leased += 1
                if len(taken) == count:
                    break
            if job.num_leased == job.num_requests:
                heapq.heappop(self._pending)
        return taken


def room(
    in_flight: int, batch_running: int, batch_waiting: int, *, queue_target: int, depth: int
) -> int:
    """How many more requests to lease to a replica (the server dispatcher's rule)."""
    return lease_room(in_flight, (batch_running, batch_waiting), queue_target, depth)
