"""The workload of one bench run: which requests, when, how long, with which prompt.

Everything is drawn from the seed, each concern from a stream of its own (interactive
arrivals, interactive lengths, batch lengths, each prompt's words), so that changing one
knob (the batch size, say) leaves the other requests exactly as they were.

Lengths are long-tailed: lognormal (tail = sigma) or Pareto (tail = shape alpha, smaller is
heavier) around the given median, clipped to [MIN_LEN, MAX_LEN], then fitted to the
context: prompt + output <= max_model_len - TEMPLATE_MARGIN, both shrunk in proportion
where they do not fit.

A prompt is `prompt_len` words from WORDS, each one token in the common BPE vocabularies
(GPT-2, Llama, Qwen, SmolLM), with or without the space before it, so that the prompt is
about `prompt_len` tokens plus the chat template's (exactly, with SmolLM2's tokenizer).
Each prompt's words are its own random draw, so that no prefix cache serves them (two
prompts share a 16-token block with odds of 224**-16), unless `shared_prefix_tokens` asks
for a common start.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

MIN_LEN = 4
MAX_LEN = 16_000
TEMPLATE_MARGIN = 64  # tokens of the context left to the chat template around the prompt

Kind = Literal["interactive", "batch"]
LENGTH_DISTS = ("lognormal", "pareto")

_WORD_TEXT = """time year people way day man thing woman life child world school state
    family student group country problem hand part place case week company system program
    question work government number night point home water room mother area money story fact
    month lot right study book eye job word business issue side kind head house service
    friend father power hour game line end member law car city community name president team
    minute idea kid body information back parent face others level office door health person
    art war history party result change reason research girl moment air teacher force
    education foot boy age policy process music market sense nation plan college interest
    death experience effect use class control care field development role rate heart drug
    show leader light voice wife mind price report decision son view relationship town road
    arm difference value building action model season tax director position player record
    paper space ground form event official matter center site project activity star table
    need court oil cost industry figure street image phone data picture practice piece land
    product doctor wall patient worker news test movie north love support technology step
    baby computer type attention film tree source organization hair window evidence
    population truth song energy river ship stone bread glass horse snow rain cloud summer
    winter bird fish apple chair bridge forest letter train ocean"""
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class WorkloadConfig:
    rate: float = 1.0  # interactive requests per second, Poisson
    duration_s: float = 60.0  # interactive arrivals fall in [0, duration_s)
    num_batch: int = 0  # batch requests, all submitted at time 0
    max_model_len: int = 8192
    prompt_len_median: int = 512
    output_len_median: int = 128
    length_dist: str = "lognormal"
    length_tail: float = 1.0
    shared_prefix_tokens: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate < 0 or not math.isfinite(self.rate):
            raise ValueError(f"rate must be a finite number >= 0, got {self.rate}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be above 0 seconds, got {self.duration_s}")
        if self.num_batch < 0:
            raise ValueError(f"num_batch must be >= 0, got {self.num_batch}")
        if self.max_model_len < TEMPLATE_MARGIN + 2 * MIN_LEN:
            raise ValueError(
                f"max_model_len must be at least {TEMPLATE_MARGIN + 2 * MIN_LEN} (the chat "
                f"template's margin and two {MIN_LEN}-token lengths), got {self.max_model_len}"
            )
        for name in ("prompt_len_median", "output_len_median"):
            if not MIN_LEN <= getattr(self, name) <= MAX_LEN:
                raise ValueError(f"{name} must be in [{MIN_LEN}, {MAX_LEN}]")
        if self.length_dist not in LENGTH_DISTS:
            raise ValueError(f"length_dist must be one of {LENGTH_DISTS}")
        if not self.length_tail > 0:
            raise ValueError(f"length_tail must be above 0, got {self.length_tail}")
        if self.shared_prefix_tokens < 0:
            raise ValueError("shared_prefix_tokens must be >= 0")


@dataclass(frozen=True)
class RequestSpec:
    req_id: str  # also the batch custom_id: [a-zA-Z0-9_-]
    kind: Kind
    arrival_s: float  # since the run's start; 0 for the batch
    prompt_len: int  # words of the prompt
    output_len: int  # max_tokens (exactly the output with ignore_eos)


def sample_length(rng: random.Random, median: int, dist: str, tail: float) -> int:
    """One length around `median`, clipped to [MIN_LEN, MAX_LEN]."""
    if dist == "lognormal":
        value = rng.lognormvariate(math.log(median), tail)
    else:  # Pareto with scale x_m: its median is x_m * 2 ** (1 / alpha)
        value = median / 2 ** (1 / tail) * rng.paretovariate(tail)
    return min(max(round(value), MIN_LEN), MAX_LEN)


def fit_context(prompt_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """(prompt, output) with prompt + output within the context less the template margin;
    a pair over it shrinks in proportion, each kept at MIN_LEN at least."""
    budget = max_model_len - TEMPLATE_MARGIN
    if prompt_len + output_len <= budget:
        return prompt_len, output_len
    output = round(output_len * budget / (prompt_len + output_len))
    output = min(max(output, MIN_LEN), budget - MIN_LEN)
    return budget - output, output


def poisson_arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    """Arrival times of a Poisson process at `rate` per second within [0, duration_s)."""
    times: list[float] = []
    if rate == 0:
        return times
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    """The interactive requests in arrival order, then the batch's."""
    arrivals = poisson_arrivals(
        random.Random(f"{config.seed}:arrivals"), config.rate, config.duration_s
    )

    def lengths(rng: random.Random) -> tuple[int, int]:
        prompt = sample_length(
            rng, config.prompt_len_median, config.length_dist, config.length_tail
        )
        output = sample_length(
            rng, config.output_len_median, config.length_dist, config.length_tail
        )
        return fit_context(prompt, output, config.max_model_len)

    specs = []
    rng = random.Random(f"{config.seed}:interactive")
    for i, t in enumerate(arrivals):
        specs.append(RequestSpec(f"i-{i:06d}", "interactive", t, *lengths(rng)))
    rng = random.Random(f"{config.seed}:batch")
    for i in range(config.num_batch):
        specs.append(RequestSpec(f"b-{i:06d}", "batch", 0.0, *lengths(rng)))
    return specs


def prompt_text(config: WorkloadConfig, spec: RequestSpec) -> str:
    """The prompt of one request: its shared prefix (if any), then words of its own."""
    num_shared = min(config.shared_prefix_tokens, spec.prompt_len)
    shared = random.Random(f"{config.seed}:prefix")
    words = [shared.choice(WORDS) for _ in range(num_shared)]
    own = random.Random(f"{config.seed}:prompt:{spec.req_id}")
    words += [own.choice(WORDS) for _ in range(spec.prompt_len - num_shared)]
    return " ".join(words)
