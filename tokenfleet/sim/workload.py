"""What the simulated fleet is asked to do: interactive arrivals and batch jobs.

Interactive requests arrive as a Poisson process whose rate follows a daily curve
(`peak_rate` times the hour's factor, by thinning), with long-tailed prompt and output
lengths (loadgen's sample_length, up to 16,000 tokens). Most prompts start with one of a
few shared system prompts, so prefix caching and prefix-aware routing matter. Batch jobs
of up to 100,000 requests arrive at set times with a deadline (24 h by default).

An hour of the curve lasts `hour_s` simulated seconds: 3,600 for a real day, less for a
compressed one (the curve's shape in less time; every request still takes its real time,
so against the curve requests last `compression` times longer).

Every draw comes from the seed, each concern from its own stream, and requests are made
lazily: a day of arrivals is never held in memory at once. A request is an Arrival (its
lengths and shared prefix); its token ids are made by prompt_token_ids.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

from tokenfleet.loadgen.workload import LENGTH_DISTS, MAX_LEN, MIN_LEN, fit_context, sample_length

INTERACTIVE, BATCH = "interactive", "batch"
DAY_S = 24 * 3600.0
# Hourly factors of the peak rate: a quiet night, a morning climb, an afternoon peak.
DEFAULT_DAILY_CURVE = (
    0.25, 0.2, 0.18, 0.18, 0.2, 0.3, 0.45, 0.65, 0.8, 0.9, 0.95, 1.0,
    1.0, 1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4, 0.3,
)  # fmt: skip
# Token ids: system prompts and each request's own part never overlap, and never hold
# the sampled token (replica.OUTPUT_TOKEN).
_SYSTEM_BASE = 1_000_000
_SYSTEM_STRIDE = 100_000
_OWN_BASE = 1 << 32


@dataclass(frozen=True)
class Arrival:
    index: int  # unique over the run: names the request and its own tokens
    kind: str
    arrival_s: float
    prompt_len: int  # in all, the shared prefix included
    output_len: int  # exactly (max_tokens; the simulated model never stops early)
    prefix_id: int = -1  # which shared system prompt, -1 for none
    prefix_len: int = 0
    job_id: int = -1  # the batch job

    @property
    def req_id(self) -> str:
        return f"{self.kind[0]}-{self.index}"


def prompt_token_ids(arrival: Arrival) -> list[int]:
    """The shared system prompt's tokens, then tokens of this request's own."""
    prefix_len = min(arrival.prefix_len, arrival.prompt_len) if arrival.prefix_id >= 0 else 0
    shared = _SYSTEM_BASE + arrival.prefix_id * _SYSTEM_STRIDE
    slot = 2 * arrival.index + (arrival.kind == BATCH)
    own = _OWN_BASE + slot * (MAX_LEN + 1)
    return [*range(shared, shared + prefix_len), *range(own, own + arrival.prompt_len - prefix_len)]


@dataclass(frozen=True)
class Lengths:
    """Long-tailed lengths around medians, prompts capped (the SLO covers prompts up to
    max_prompt_len), prompt + output within max_model_len."""

    prompt_median: int = 1024
    output_median: int = 256
    dist: str = "lognormal"
    tail: float = 1.0
    max_prompt_len: int = MAX_LEN
    max_model_len: int = MAX_LEN + 1024

    def __post_init__(self) -> None:
        if self.dist not in LENGTH_DISTS:
            raise ValueError(f"dist must be one of {LENGTH_DISTS}, got {self.dist!r}")
        for name in ("prompt_median", "output_median", "max_prompt_len"):
            if not MIN_LEN <= getattr(self, name) <= MAX_LEN:
                raise ValueError(f"{name} must be in [{MIN_LEN}, {MAX_LEN}]")

    def draw(self, rng: random.Random) -> tuple[int, int]:
        prompt = min(
            sample_length(rng, self.prompt_median, self.dist, self.tail), self.max_prompt_len
        )
        output = sample_length(rng, self.output_median, self.dist, self.tail)
        return fit_context(prompt, output, self.max_model_len)


@dataclass(frozen=True)
class SharedPrompts:
    """`share` of requests start with one of `count` system prompts of `length` tokens,
    picked with Zipf-like weights 1/(i+1)."""

    count: int = 8
    length: int = 512
    share: float = 0.8

    def draw(self, rng: random.Random) -> tuple[int, int]:
        if self.count == 0 or rng.random() >= self.share:
            return -1, 0
        weights = [1 / (i + 1) for i in range(self.count)]
        return rng.choices(range(self.count), weights)[0], self.length


@dataclass(frozen=True)
class InteractiveWorkload:
    peak_rate: float = 10.0  # requests per second at the curve's peak, fleet-wide
    daily_curve: tuple[float, ...] = DEFAULT_DAILY_CURVE
    start_hour: float = 0.0  # the hour of day the simulation starts at
    hour_s: float = 3600.0  # simulated seconds an hour of the curve lasts (< 3600: compressed)
    lengths: Lengths = Lengths(max_prompt_len=4000)
    prompts: SharedPrompts = SharedPrompts()

    def __post_init__(self) -> None:
        if self.peak_rate < 0 or not self.daily_curve:
            raise ValueError("peak_rate must be >= 0 and daily_curve not empty")
        if any(not 0 <= f <= 1 for f in self.daily_curve):
            raise ValueError("daily_curve factors must be in [0, 1] (of the peak rate)")
        hour_s = self.hour_s  # NaN and infinity fail the range too
        if (
            isinstance(hour_s, bool)
            or not isinstance(hour_s, int | float)
            or not 0 < hour_s <= 3600
        ):
            raise ValueError(
                "hour_s (simulated seconds an hour of the daily curve lasts) must be a number "
                f"in (0, 3600], got {self.hour_s!r}"
            )

    @property
    def compression(self) -> float:
        """How many times faster than a real day the curve runs (1 for hour_s = 3600)."""
        return DAY_S / 24 / self.hour_s

    def rate_at(self, t: float) -> float:
        """Requests per second at `t` simulated seconds into the run (hours of the curve,
        each `hour_s` long, cyclic)."""
        hour = (self.start_hour + t / self.hour_s) % 24
        slot = int(hour * len(self.daily_curve) / 24) % len(self.daily_curve)
        return self.peak_rate * self.daily_curve[slot]


@dataclass(frozen=True)
class BatchJob:
    submit_s: float = 0.0
    num_requests: int = 1000
    deadline_s: float = DAY_S  # after submission
    lengths: Lengths = Lengths(prompt_median=1024, output_median=256)
    prompts: SharedPrompts = SharedPrompts(count=1, length=1024, share=1.0)

    def __post_init__(self) -> None:
        if not 1 <= self.num_requests <= 100_000:
            raise ValueError(f"a batch job has 1 to 100,000 requests, got {self.num_requests}")

    def on_clock_of(self, workload: InteractiveWorkload) -> BatchJob:
        """The job with its submit_s and deadline_s, given on a real day's clock, put on
        the workload's: divided by its compression (a 24 h deadline is a day of the curve)."""
        factor = workload.compression
        if factor == 1:
            return self
        return replace(self, submit_s=self.submit_s / factor, deadline_s=self.deadline_s / factor)


def interactive_arrivals(
    workload: InteractiveWorkload, duration_s: float, seed: int
) -> Iterator[Arrival]:
    """Arrivals in time order within [0, duration_s), by thinning a Poisson process at the
    peak rate."""
    if workload.peak_rate == 0:
        return
    times = random.Random(f"{seed}:interactive-arrivals")
    draws = random.Random(f"{seed}:interactive-requests")
    t = 0.0
    index = 0
    while True:
        t += times.expovariate(workload.peak_rate)
        if t >= duration_s:
            return
        if times.random() * workload.peak_rate >= workload.rate_at(t):
            continue
        prompt, output = workload.lengths.draw(draws)
        prefix_id, prefix_len = workload.prompts.draw(draws)
        yield Arrival(index, INTERACTIVE, t, prompt, output, prefix_id, prefix_len)
        index += 1


def batch_requests(job: BatchJob, job_id: int, first_index: int, seed: int) -> Iterator[Arrival]:
    """A job's requests, in order, made as the dispatcher leases them. Job prefixes are
    their own (ids from 1000 up), not the interactive system prompts."""
    rng = random.Random(f"{seed}:batch-job:{job_id}")
    for i in range(job.num_requests):
        prompt, output = job.lengths.draw(rng)
        prefix_id, prefix_len = job.prompts.draw(rng)
        if prefix_id >= 0:
            prefix_id += 1000 + job_id * job.prompts.count
        yield Arrival(
            first_index + i, BATCH, job.submit_s, prompt, output, prefix_id, prefix_len, job_id
        )


def daily_volume(workload: InteractiveWorkload) -> float:
    """Interactive requests expected in one day of the curve (24 x hour_s seconds)."""
    hours = len(workload.daily_curve)
    return workload.peak_rate * sum(workload.daily_curve) * 24 * workload.hour_s / hours
