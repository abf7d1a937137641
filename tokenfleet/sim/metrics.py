"""What a simulation records: per-request latencies by class, batch jobs against their
deadlines, accelerator time, and the fleet over time.

Latencies are kept as compact arrays (8 bytes a request) so a day of a large fleet fits;
a request's TPOT is (last token - first token) / (output tokens - 1), as the load
generator measures it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from tokenfleet.sim.workload import BATCH, INTERACTIVE, Arrival


@dataclass(frozen=True)
class Targets:
    """The design's latency targets (interactive, prompts up to 4,000 tokens)."""

    ttft_p50_s: float = 0.5
    ttft_p99_s: float = 2.0
    tpot_p50_s: float = 0.04
    tpot_p99_s: float = 0.06

    def met_by(self, ttft_s: float, tpot_s: float) -> bool:
        """One request within the p99 targets (what SLO attainment counts)."""
        return ttft_s <= self.ttft_p99_s and tpot_s <= self.tpot_p99_s


@dataclass
class ClassLog:
    ttft_s: array[float] = field(default_factory=lambda: array("d"))
    tpot_s: array[float] = field(default_factory=lambda: array("d"))
    num_finished: int = 0
    num_refused: int = 0
    num_unfinished: int = 0  # still running when the simulation ended
    unfinished_output_tokens: int = 0  # what those had made by then
    num_met: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass
class InFlight:
    """A request the fleet has taken and not finished."""

    arrival: Arrival
    pool: int
    replica_id: int
    first_token_at: float | None = None
    routed_tokens: int = 0  # prompt tokens the router believed it had to prefill


@dataclass
class Sample:
    time_s: float
    replicas: list[int]  # per pool: serving (draining ones included)
    kv_usage: list[float]  # per pool: blocks used / blocks, over its serving replicas
    starting: list[int] = field(default_factory=list)  # per pool: asked for, not serving yet
    draining: list[int] = field(default_factory=list)  # per pool: of `replicas`, draining
    # Fleet-wide, since the start: interactive requests arrived, finished, refused, and
    # finished within both p99 targets (differences between samples give a window's).
    interactive_arrived: int = 0
    interactive_finished: int = 0
    interactive_refused: int = 0
    interactive_met: int = 0
    # Per batch job submitted by then: output tokens of its finished requests.
    batch_output_tokens: dict[int, int] = field(default_factory=dict)


@dataclass
class Metrics:
    targets: Targets
    classes: dict[str, ClassLog] = field(
        default_factory=lambda: {INTERACTIVE: ClassLog(), BATCH: ClassLog()}
    )
    samples: list[Sample] = field(default_factory=list)
    accelerator_s: float = 0.0
    num_steps: int = 0
    num_leap_steps: int = 0
    last_finish_s: float = 0.0

    def finish(self, request: InFlight, now: float) -> bool:
        """Record a finished request; whether it met the targets (batch: always)."""
        arrival = request.arrival
        log = self.classes[arrival.kind]
        first = request.first_token_at if request.first_token_at is not None else now
        ttft = first - arrival.arrival_s
        tpot = (now - first) / (arrival.output_len - 1) if arrival.output_len > 1 else 0.0
        log.ttft_s.append(ttft)
        log.tpot_s.append(tpot)
        log.num_finished += 1
        self.last_finish_s = max(self.last_finish_s, now)
        log.prompt_tokens += arrival.prompt_len
        log.output_tokens += arrival.output_len
        met = arrival.kind == BATCH or self.targets.met_by(ttft, tpot)
        log.num_met += met
        return met
