"""The engine step's own cost (issue 32): `EngineCore` in this process with a stand-in
runner that holds each step for `--forward-ms` without holding the GIL (a sleep, as a real
forward leaves the GIL to the host) and answers with tokens, at 64, 256 and 512 running
requests. Figures: the engine's CPU time a step outside the forward, by part and per
running request; the share of wall time the stand-in accelerator sits idle; steps/s.

Workload, steady: `N` requests run (max_num_seqs = N) and N/16 more wait; each one that
finishes is replaced before the next step, so every step has decodes, prefill chunks of the
newcomers' prompts (`--prompt-len`, tokens drawn at random: no prefix hits), finishes by
length and arrivals. Half interactive, half batch (priority scheduling, harvest budget,
the step-time model fitted online); `--constrained` of the requests (and so of the rows)
follow a JSON schema with long strings. The first N + N/16 requests have short prompts and
outputs of 1..max tokens, so that finishes are spread from the start; `--warmup-steps`
are then dropped and `--steps` measured, in `--rounds` segments, the engines (`--engine`)
taking turns, so that a slow spell of the machine falls on all alike.

The stand-in (StandInRunner) is a ModelRunner with no model: EngineCore treats it as the
real one, so constraints compile (the real GrammarCompiler on the model's tokenizer.json),
the masks fill beside the forward on the mask thread, and the start-up profile runs. Before
its hold it builds the forward's inputs with ModelRunner's own host_inputs (token ids,
positions, AttentionMetadata over the block tables: the host's share of a launch); during
it, it applies the constrained rows' masks to stand-in logits and takes their argmax (so
those rows pick tokens their grammar allows); the other rows get one fixed token. It is
made by EngineCore itself, through the name the fixed runner has in engine/core.py,
swapped while the engine is built.

Parts, as CPU time of the step thread (time.thread_time; a part called inside another is
its own alone), grouped as the issue names them:
  scheduling  add_request, admitting compiled constraints, Scheduler.schedule (plan),
              the harvest budgets, _commit, the step-time model (features, predict,
              observe: it refits every step)
  inputs      the runner's inputs; starting the constrained rows' mask fill
  outputs     the matchers' advance, Scheduler.update, the runner's token dict
  messaging   decoding the arrivals' wire messages (engine/process.py's decode_requests),
              stats(), encoding the step's message (encode_step)
  other       the rest of the step's loop (EngineCore.step's own glue)
The forward's window (the hold, and the masks applied in it) is left out; "all threads"
adds the other threads' CPU (the mask fill's above all). "Exposed": the gap between a
hold's end and the next one's start, what the accelerator waits for the host: with the
overlap (the next step planned during the forward) it is well below the engine's CPU time.
Idle share: (sum of gaps) / (sum of holds and gaps); a hold is the forward's time (a mask
fill that outlasts it is the host's). The goals' "outside the overlap" is the exposed time
per running request.

`--engine NAME[:FIELD=VALUE,...]` (repeat) runs the same workload on engines built with
those EngineConfig fields (values as JSON, else text), side by side; by default two,
"overlap" (overlap=true) and "no-overlap" (overlap=false).

Goals (issue 32), at 256 running with a 20 ms forward: the accelerator idle under 5% of
the wall time; under 5 us of engine CPU per running request per step outside the overlap.

    .venv/bin/python bench/step_overhead.py          # 1-2 minutes

Writes step_overhead.json and step_overhead.png into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
from common.log import log
from common.results import RunStart, args_json, format_table, write_result
from common.schemas import closed_object
from common.stats import percentile

import tokenfleet.engine.core as core_module
from tokenfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.sampling_params import Constraint, SamplingParams
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.process import decode_requests, encode_step
from tokenfleet.models.config import ModelConfig
from tokenfleet.runner.block_tables import BlockTables
from tokenfleet.runner.grammar import TokenMasks
from tokenfleet.runner.model_runner import (
    HostInputs,
    ModelRunner,
    fill_input_placeholders,
    host_inputs,
)

RESULT_NAME = "step_overhead"
GOAL_RUNNING = 256
GOAL_FORWARD_S = 0.020
GOAL_IDLE_SHARE = 0.05
GOAL_CPU_PER_REQUEST_S = 5e-6
BLOCK_SIZE = 16
FIRST_PROMPT_LEN = 2 * BLOCK_SIZE  # the first requests': prefilled at once
NOISE_ROWS = 64  # stand-in logits the constrained rows take turns with
FORWARD = "forward"  # the hold's part: not the engine's
PARTS = {  # part -> group, in the order a step runs them
    "decode arrivals": "messaging",
    "add_request": "scheduling",
    "admit compiled": "scheduling",
    "harvest budget": "scheduling",
    "plan": "scheduling",
    "commit": "scheduling",
    "step model": "scheduling",
    "mask fill start": "inputs",
    "inputs": "inputs",
    "matchers advance": "outputs",
    "update": "outputs",
    "runner tokens": "outputs",
    "stats": "messaging",
    "encode": "messaging",
    "other": "other",
}
GROUPS = ("scheduling", "inputs", "outputs", "messaging", "other")


# Long strings, so that a constrained row runs about as long as the others (max_tokens
# ends most of them) and the constrained share of rows is about that of requests.
SCHEMAS = tuple(
    Constraint("json_schema", json.dumps(schema))
    for schema in (
        closed_object(
            {
                "summary": {"type": "string", "maxLength": 2000},
                "score": {"type": "integer", "minimum": 0, "maximum": 10},
            }
        ),
        closed_object(
            {
                "title": {"type": "string", "maxLength": 200},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 50},
            }
        ),
        closed_object(
            {
                "verdict": {"enum": ["yes", "no", "unsure"]},
                "reason": {"type": "string", "maxLength": 2000},
            }
        ),
    )
)


# -- the parts' clock --------------------------------------------------------------------


class PartClock:
    """CPU time of each thread by part: a part entered within another is charged for its
    own time alone (the outer part's clock pauses)."""

    def __init__(self) -> None:
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self._local = threading.local()

    def _stack(self) -> list[list[Any]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def enter(self, part: str) -> None:
        now = time.thread_time()
        stack = self._stack()
        if stack:
            self.cpu[stack[-1][0]] += now - stack[-1][1]
        stack.append([part, now])

    def exit(self) -> None:
        now = time.thread_time()
        stack = self._stack()
        part, started = stack.pop()
        self.cpu[part] += now - started
        if stack:
            stack[-1][1] = now

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def wrap(
        self, name: str, f: Callable[..., Any], *, not_within: str | None = None
    ) -> Callable[..., Any]:
        """`f` timed as part `name`, but where called within part `not_within`: there
        it is that part's."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._stack()
            if not_within is not None and stack and stack[-1][0] == not_within:
                return f(*args, **kwargs)
            self.enter(name)
            try:
                return f(*args, **kwargs)
            finally:
                self.exit()

        return timed

    def take(self) -> dict[str, float]:
        taken = dict(self.cpu)
        self.cpu.clear()
        return taken


CLOCK = PartClock()


# -- the stand-in runner -----------------------------------------------------------------


class StandInRunner(ModelRunner):
    """A runner with no model: inputs built as ModelRunner builds them, then the step held
    for `forward_s` without the GIL; the constrained rows' masks are applied in the hold.
    A ModelRunner to EngineCore's isinstance checks (constraints, the profile, masks)."""

    def __init__(
        self, config: ModelConfig, token_id: int, num_blocks: int, block_size: int, forward_s: float
    ) -> None:  # no super().__init__: no weights, no KV tensors
        self.config = config
        self.token_id = token_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device("cpu")
        self.block_tables = BlockTables(max_blocks_per_seq=64)
        self.forward_s = forward_s
        self.noise = torch.randn(
            NOISE_ROWS, config.vocab_size, generator=torch.Generator().manual_seed(0)
        )
        self.num_steps = 0
        # Each step's record, taken by the bench: the hold (s), the accelerator's wait before
        # it (the gap since the previous hold ended), rows, prefill rows and tokens,
        # constrained rows. With the overlap the step runs on the engine's forward thread.
        self.done: list[dict[str, float]] = []
        self._last_end: float | None = None

    def prepare(  # type: ignore[override]
        self, so: SchedulerOutput
    ) -> tuple[SchedulerOutput, HostInputs | None]:
        """The inputs as ModelRunner.prepare makes them (on the engine's loop)."""
        with CLOCK.part("inputs"):
            if so.is_empty:
                self.block_tables.update(so)  # the requests it says ended
                return so, None
            return so, host_inputs(
                so, self.block_tables, self.block_size, self.device, self.config.sliding_window
            )

    @staticmethod
    def fill_placeholders(  # type: ignore[override]
        inputs: tuple[SchedulerOutput, HostInputs | None], sampled: Mapping[str, int]
    ) -> None:
        if inputs[1] is not None:
            with CLOCK.part("inputs"):
                fill_input_placeholders(inputs[1], sampled)

    def run(  # type: ignore[override]
        self, inputs: tuple[SchedulerOutput, HostInputs | None], masks: TokenMasks | None = None
    ) -> ModelRunnerOutput:
        so = inputs[0]
        if so.is_empty:
            return ModelRunnerOutput({})
        with CLOCK.part(FORWARD):
            launched = time.perf_counter()
            picks = self._constrained_picks(masks)
            picked_s = time.perf_counter() - launched
            time.sleep(max(0.0, self.forward_s - picked_s))
            # The accelerator's time: the forward (a sleep's overshoot with it); a mask
            # fill that outlasts it keeps the host busy, not the accelerator.
            ended = time.perf_counter()
            hold_s = ended - launched if picked_s < self.forward_s else self.forward_s
        with CLOCK.part("runner tokens"):
            token = self.token_id
            sampled = {s.req_id: picks.get(s.req_id, token) for s in so.scheduled if s.sample}
        self.num_steps += 1
        prefills = [s.num_tokens for s in so.scheduled if s.num_tokens > 1]
        gap_s = 0.0 if self._last_end is None else max(0.0, launched - self._last_end)
        self._last_end = launched + hold_s
        self.done.append(
            {
                "hold_s": hold_s,
                "gap_s": gap_s,
                "rows": len(so.scheduled),
                "prefill_rows": len(prefills),
                "prefill_tokens": sum(prefills),
                "constrained_rows": 0 if masks is None else len(masks.req_ids),
                "masks_late_s": max(0.0, picked_s - self.forward_s),
            }
        )
        return ModelRunnerOutput(sampled)

    def _constrained_picks(self, masks: TokenMasks | None) -> dict[str, int]:
        """Each constrained row's token: the argmax of stand-in logits under its mask."""
        if masks is None:
            return {}
        req_ids = masks.req_ids
        rows = (torch.arange(len(req_ids)) * 7 + self.num_steps) % NOISE_ROWS
        logits, failed = masks.apply(
            self.noise.index_select(0, rows), req_ids, [False] * len(req_ids)
        )
        tokens = logits.argmax(dim=-1).tolist()
        return {r: t for r, t in zip(req_ids, tokens, strict=True) if r not in failed}


@contextlib.contextmanager
def engine_patched(num_blocks: int) -> Iterator[None]:
    """While the engine is built: its fixed runner is a StandInRunner with `num_blocks`
    blocks (the fixed runner's count is a constant), its step holding `fixed_step_s`."""
    saved = core_module.FixedTokenRunner

    def stand_in(
        config: ModelConfig, token_id: int, _num_blocks: int, *, step_s: float, **_: Any
    ) -> StandInRunner:
        return StandInRunner(config, token_id, num_blocks, BLOCK_SIZE, step_s)

    core_module.FixedTokenRunner = stand_in  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        core_module.FixedTokenRunner = saved  # type: ignore[misc]


@contextlib.contextmanager
def parts_timed() -> Iterator[None]:
    """The engine module's own names for the harvest budgets and the step features,
    timed by CLOCK while the benchmark runs."""
    saved_budgets, saved_features = core_module.PriorityBudgets, core_module.step_features

    class TimedBudgets(saved_budgets):  # type: ignore[misc,valid-type]
        def prefill_budget(self) -> int | None:
            with CLOCK.part("harvest budget"):
                return super().prefill_budget()

        def batch_budget(self, interactive_chunks: list[tuple[int, int]]) -> int:
            with CLOCK.part("harvest budget"):
                return super().batch_budget(interactive_chunks)

    core_module.PriorityBudgets = TimedBudgets  # type: ignore[misc]
    core_module.step_features = CLOCK.wrap("step model", saved_features)
    try:
        yield
    finally:
        core_module.PriorityBudgets = saved_budgets  # type: ignore[misc]
        core_module.step_features = saved_features


def time_parts(core: EngineCore) -> None:
    """This engine's methods that a step calls, timed by CLOCK (instance attributes)."""
    scheduler, matchers = core.scheduler, core.matchers
    timed = (
        (scheduler, "schedule", "plan"),
        (scheduler, "_commit", "commit"),
        (scheduler, "update", "update"),
        (core.step_model, "observe", "step model"),
        (matchers, "start_fill", "mask fill start"),
        (matchers, "fill_later", "mask fill start"),
        (matchers, "submit", "mask fill start"),
        (matchers, "advance", "matchers advance"),
        (matchers, "remove", "matchers advance"),
        (core, "_admit_compiled", "admit compiled"),
        (core, "stats", "stats"),
    )
    for owner, name, part in timed:
        setattr(owner, name, CLOCK.wrap(part, getattr(owner, name)))
    # The harvest budgets price their chunks with predict too: theirs stays theirs.
    predict = CLOCK.wrap("step model", core.step_model.predict, not_within="harvest budget")
    setattr(core.step_model, "predict", predict)  # noqa: B010


# -- the workload ------------------------------------------------------------------------


@dataclass(frozen=True)
class Way:
    """An engine to compare: a name and the EngineConfig fields it sets."""

    name: str
    overrides: dict[str, Any]

    @classmethod
    def parse(cls, text: str) -> Way:
        name, _, rest = text.partition(":")
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        overrides: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key not in known:
                raise argparse.ArgumentTypeError(f"EngineConfig has no field {key!r}")
            try:
                overrides[key] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key] = value
        return cls(name, overrides)


class Workload:
    """The requests of one engine at one size, seeded: the same for every engine."""

    def __init__(self, args: argparse.Namespace, running: int) -> None:
        self.args = args
        self.rng = random.Random(running)
        self.num_made = 0
        self.encoder = msgspec.msgpack.Encoder()

    def request(self, first: bool) -> msgspec.Raw:
        """The next request, as the gateway sends it (one request of an AddRequests)."""
        args, rng = self.args, self.rng
        self.num_made += 1
        if first:  # a short prompt and any remaining length: finishes spread from step 1
            prompt_len, max_tokens = FIRST_PROMPT_LEN, rng.randint(1, args.output_len[1])
        else:
            prompt_len, max_tokens = rng.randint(*args.prompt_len), rng.randint(*args.output_len)
        constrained = rng.random() < args.constrained
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            constraint=SCHEMAS[self.num_made % len(SCHEMAS)] if constrained else None,
        )
        interactive = rng.random() < args.interactive
        request = EngineCoreRequest(
            f"r{self.num_made}",
            [rng.randrange(100, 40000) for _ in range(prompt_len)],
            params,
            time.monotonic(),
            PRIORITY_INTERACTIVE if interactive else PRIORITY_BATCH,
        )
        return msgspec.Raw(self.encoder.encode(request))


@dataclass
class Bench:
    """One engine at one size, stepping its workload."""

    way: Way
    running: int
    core: EngineCore
    workload: Workload
    arrivals: list[msgspec.Raw]
    steps: list[dict[str, Any]] = field(default_factory=list)
    encoder: msgspec.msgpack.Encoder = field(default_factory=msgspec.msgpack.Encoder)

    def step(self) -> dict[str, Any]:
        """One turn of the engine process's loop: arrivals decoded and added, the step,
        its message encoded. Returns what it measured."""
        core = self.core
        CLOCK.take()
        process_cpu = time.process_time()
        began = time.perf_counter()
        CLOCK.enter("other")
        with CLOCK.part("decode arrivals"):
            requests, refused = decode_requests(self.arrivals)
        assert not refused, refused
        for request in requests:
            with CLOCK.part("add_request"):
                core.add_request(request)
        outputs = core.step()
        with CLOCK.part("encode"):
            encode_step(self.encoder, outputs, core.fail_requests)
        CLOCK.exit()
        wall_s = time.perf_counter() - began
        process_cpu = time.process_time() - process_cpu
        parts = CLOCK.take()
        runner = core.runner
        assert isinstance(runner, StandInRunner)
        reasons = [o.finish_reason for o in outputs.outputs if o.finished]
        finished = len(reasons)
        # The forward this step ran (that of the step planned ahead has not ended yet).
        done, runner.done = runner.done, []
        assert len(done) <= 1, done
        forward = (
            done[0]
            if done
            else {"hold_s": 0.0, "gap_s": 0.0, "rows": 0, "prefill_rows": 0, "prefill_tokens": 0}
        )
        record = {
            "wall_s": wall_s,
            "arrivals": len(requests),
            "finishes": finished,
            "finish_reasons": reasons,
            "running": len(core.scheduler.running),
            "parts_s": {k: v for k, v in parts.items() if k != FORWARD},
            "forward_cpu_s": parts.get(FORWARD, 0.0),
            "process_cpu_s": process_cpu,
            **forward,
        }
        self.arrivals = [self.workload.request(first=False) for _ in range(finished)]
        return record


def build(args: argparse.Namespace, way: Way, running: int) -> Bench:
    queued = max(2, running // 16)
    population = running + queued
    per_request = -(-(args.prompt_len[1] + args.output_len[1]) // BLOCK_SIZE)
    num_blocks = population * per_request * 3 // 2  # room: no preemption for want of blocks
    config = EngineConfig(
        runner="fixed",
        fixed_step_s=args.forward_ms / 1000,
        num_threads=args.num_threads,
        cache=CacheConfig(block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(
            max_num_seqs=running,
            max_num_batched_tokens=running + args.prefill_tokens,
            max_model_len=args.prompt_len[1] + args.output_len[1] + BLOCK_SIZE,
        ),
        **way.overrides,
    )
    with engine_patched(num_blocks):
        core = EngineCore(config)
    assert core.grammar is not None, "the stand-in should have the engine compile constraints"
    time_parts(core)
    assert isinstance(core.runner, StandInRunner)
    core.runner.done.clear()  # the start-up profile's steps
    workload = Workload(args, running)
    arrivals = [workload.request(first=True) for _ in range(population)]
    return Bench(way, running, core, workload, arrivals)


# -- figures -----------------------------------------------------------------------------


def summarize(bench: Bench, num_warmup: int) -> dict[str, Any]:
    steps = [s for s in bench.steps[num_warmup:] if not s["first_of_segment"]]
    rows = [max(1, s["rows"]) for s in steps]
    cpu = [sum(s["parts_s"].values()) for s in steps]
    all_threads = [s["process_cpu_s"] - s["forward_cpu_s"] for s in steps]
    exposed = [s["gap_s"] for s in steps]
    wall = sum(s["wall_s"] for s in steps)
    accelerator = sum(s["hold_s"] + s["gap_s"] for s in steps)

    def figures(values: list[float]) -> dict[str, float]:
        per_row = [v / n for v, n in zip(values, rows, strict=True)]
        return {
            "p50_s": percentile(values, 50),
            "p90_s": percentile(values, 90),
            "mean_s": statistics.fmean(values),
            "per_request_p50_s": percentile(per_row, 50),
            "per_request_p90_s": percentile(per_row, 90),
            "per_request_mean_s": statistics.fmean(per_row),
        }

    parts = {
        name: {"group": group} | figures([s["parts_s"].get(name, 0.0) for s in steps])
        for name, group in PARTS.items()
    }
    groups = {
        group: figures(
            [
                sum(v for k, v in s["parts_s"].items() if PARTS.get(k, "other") == group)
                for s in steps
            ]
        )
        for group in GROUPS
    }
    stats = bench.core.stats()
    return {
        "engine": bench.way.name,
        "overrides": bench.way.overrides,
        "running": bench.running,
        "steps": len(steps),
        "rows_p50": percentile(rows, 50),
        "running_min": min(s["running"] for s in steps),
        "prefill_rows_mean": statistics.fmean(s["prefill_rows"] for s in steps),
        "prefill_tokens_mean": statistics.fmean(s["prefill_tokens"] for s in steps),
        "constrained_rows_mean": statistics.fmean(s.get("constrained_rows", 0) for s in steps),
        # Steps whose constrained rows' masks were filled only after the forward's time.
        "masks_late_steps": sum(s.get("masks_late_s", 0.0) > 0 for s in steps),
        "arrivals_per_step": statistics.fmean(s["arrivals"] for s in steps),
        "finishes_per_step": statistics.fmean(s["finishes"] for s in steps),
        "finish_reasons": dict(Counter(r for s in steps for r in s["finish_reasons"])),
        "num_preemptions": stats.num_preemptions,
        "steps_per_s": len(steps) / wall,
        "wall_p50_s": percentile([s["wall_s"] for s in steps], 50),
        "wall_p90_s": percentile([s["wall_s"] for s in steps], 90),
        "hold_p50_s": percentile([s["hold_s"] for s in steps], 50),
        "idle_share": 1 - sum(s["hold_s"] for s in steps) / accelerator,
        "exposed": figures(exposed),
        "engine_cpu": figures(cpu),
        "all_threads_cpu": figures(all_threads),
        "groups": groups,
        "parts": parts,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.num_threads)
    results = []
    with parts_timed():
        for running in args.running:
            began = time.perf_counter()
            benches = [build(args, way, running) for way in args.engine]
            for bench in benches:
                for _ in range(args.warmup_steps):
                    bench.steps.append(bench.step() | {"first_of_segment": False})
            per_round = -(-args.steps // args.rounds)
            for r in range(args.rounds):
                order = benches[r % len(benches) :] + benches[: r % len(benches)]
                for bench in order:
                    for i in range(per_round):
                        # A segment's first two steps: a gap before them holds the other
                        # engines' segment (with the overlap, the second's forward was
                        # launched after it, the first's before it): left out.
                        bench.steps.append(bench.step() | {"first_of_segment": i < 2})
            for bench in benches:
                summary = summarize(bench, args.warmup_steps)
                results.append(summary)
                for closing in (bench.core, bench.core.grammar, bench.core.matchers):
                    if closing is not None:
                        closing.close()
                log(
                    f"{bench.way.name}, {running} running: {summary['steps_per_s']:.1f} steps/s, "
                    f"idle {summary['idle_share']:.1%}, engine CPU "
                    f"{summary['engine_cpu']['p50_s'] * 1e3:.2f} ms a step, "
                    f"{summary['engine_cpu']['per_request_p50_s'] * 1e6:.1f} us a request "
                    f"({time.perf_counter() - began:.0f} s)"
                )
    return {"results": results, "goals": goals(args, results)}


def goals(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each engine's figures at the goals' size, against them (none off that size)."""
    if GOAL_RUNNING not in args.running or abs(args.forward_ms / 1000 - GOAL_FORWARD_S) > 1e-9:
        return []
    out = []
    for r in results:
        if r["running"] != GOAL_RUNNING:
            continue
        # Outside the overlap: what the accelerator waits for.
        per_request = r["exposed"]["per_request_p50_s"]
        out.append(
            {
                "engine": r["engine"],
                "idle_share": r["idle_share"],
                "idle_met": r["idle_share"] < GOAL_IDLE_SHARE,
                "cpu_per_request_s": per_request,
                "cpu_met": per_request < GOAL_CPU_PER_REQUEST_S,
            }
        )
    return out


def tables(result: dict[str, Any]) -> str:
    head = ["engine", "running", "rows", "prefill rows", "steps/s", "wall ms", "idle"]
    head += ["exposed ms", "CPU ms (p90)", "us/req (p90)", "all threads ms"]
    head += [f"{g} us/req" for g in GROUPS]
    rows = [head]
    for r in result["results"]:
        cpu, exposed = r["engine_cpu"], r["exposed"]
        rows.append(
            [
                r["engine"],
                str(r["running"]),
                f"{r['rows_p50']:.0f}",
                f"{r['prefill_rows_mean']:.1f}",
                f"{r['steps_per_s']:.1f}",
                f"{r['wall_p50_s'] * 1e3:.1f}",
                f"{r['idle_share']:.1%}",
                f"{exposed['p50_s'] * 1e3:.2f}",
                f"{cpu['p50_s'] * 1e3:.2f} ({cpu['p90_s'] * 1e3:.2f})",
                f"{cpu['per_request_p50_s'] * 1e6:.1f} ({cpu['per_request_p90_s'] * 1e6:.1f})",
                f"{r['all_threads_cpu']['p50_s'] * 1e3:.2f}",
                *(f"{r['groups'][g]['per_request_p50_s'] * 1e6:.2f}" for g in GROUPS),
            ]
        )
    text = format_table(rows)
    # The parts that cost most, by their mean per request at the largest size.
    largest = [
        r for r in result["results"] if r["running"] == max(x["running"] for x in result["results"])
    ]
    part_rows = [["part (group)", *(f"{r['engine']} @ {r['running']}" for r in result["results"])]]
    ranked = sorted(PARTS, key=lambda p: -largest[0]["parts"][p]["per_request_mean_s"])
    for part in ranked:
        part_rows.append(
            [
                f"{part} ({PARTS[part]})",
                *(f"{r['parts'][part]['per_request_mean_s'] * 1e6:.2f}" for r in result["results"]),
            ]
        )
    text += "\n\nmean us per running request a step, by part:\n" + format_table(part_rows)
    for g in result["goals"]:
        text += (
            f"\n{g['engine']} at {GOAL_RUNNING} running, {GOAL_FORWARD_S * 1e3:.0f} ms forward: "
            f"idle {g['idle_share']:.1%} (goal < {GOAL_IDLE_SHARE:.0%}: "
            f"{'met' if g['idle_met'] else 'not met'}), "
            f"{g['cpu_per_request_s'] * 1e6:.1f} us a request outside the overlap (goal < "
            f"{GOAL_CPU_PER_REQUEST_S * 1e6:.0f} us: {'met' if g['cpu_met'] else 'not met'})"
        )
    return text


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    results = result["results"]
    engines = list(dict.fromkeys(r["engine"] for r in results))
    sizes = sorted({r["running"] for r in results})
    width = 0.8 / len(engines)
    for e, engine in enumerate(engines):
        mine = {r["running"]: r for r in results if r["engine"] == engine}
        xs = [i + (e - (len(engines) - 1) / 2) * width for i in range(len(sizes))]
        bottom = [0.0] * len(sizes)
        for g, group in enumerate(GROUPS):
            heights = [mine[n]["groups"][group]["per_request_mean_s"] * 1e6 for n in sizes]
            left.bar(
                xs,
                heights,
                width,
                bottom=bottom,
                color=f"C{g}",
                label=group if e == 0 else None,
                hatch="//" if e else None,
            )
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        idle = [mine[n]["idle_share"] * 100 for n in sizes]
        right.plot(range(len(sizes)), idle, "o-", label=engine)
    for ax in (left, right):
        ax.set_xticks(range(len(sizes)), [str(n) for n in sizes])
        ax.set_xlabel("running requests")
    left.axhline(GOAL_CPU_PER_REQUEST_S * 1e6, color="k", ls="--", label="goal")
    left.set_ylabel("engine CPU per running request a step, us (mean)")
    left.set_title(f"outside the forward, by part (bars left to right: {', '.join(engines)})")
    left.legend(fontsize="small")
    right.axhline(GOAL_IDLE_SHARE * 100, color="k", ls="--", label="goal")
    right.set_ylabel("stand-in accelerator idle, % of wall time")
    right.set_ylim(bottom=0)
    right.set_title(f"forward held {results[0]['hold_p50_s'] * 1e3:.1f} ms (median)")
    right.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--running", type=int, nargs="+", default=[64, 256, 512])
    add("--forward-ms", type=float, default=GOAL_FORWARD_S * 1000, help="the stand-in's hold")
    add("--steps", type=int, default=300, help="measured steps of each engine at each size")
    add("--warmup-steps", type=int, default=100)
    add("--rounds", type=int, default=5, help="segments the engines take turns with")
    add("--prompt-len", type=int, nargs=2, default=[32, 352], metavar=("MIN", "MAX"))
    add("--output-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    add("--prefill-tokens", type=int, default=1024, help="token budget a step beyond N decodes")
    add("--constrained", type=float, default=0.1, help="share of requests with a JSON schema")
    add("--interactive", type=float, default=0.5, help="share of requests that are interactive")
    add(
        "--engine",
        type=Way.parse,
        action="append",
        help="NAME[:FIELD=VALUE,...]: an engine with these EngineConfig fields (repeat); "
        "default: 'overlap' and 'no-overlap:overlap=false'",
    )
    add("--num-threads", type=int, default=1)
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    args.engine = args.engine or [
        Way("overlap", {"overlap": True}),
        Way("no-overlap", {"overlap": False}),
    ]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = RunStart.now()
    result = run(args)
    print(tables(result))
    provenance = start.provenance(args) | {
        "args": args_json(args) | {"engine": [dataclasses.asdict(w) for w in args.engine]}
    }
    write_result(args.out, RESULT_NAME, provenance | result, lambda path: plot(path, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
