"""Constrained decoding's cost (issue 31): the step time of the bundled model's engine with
none, half or all of its `--rows` decode rows constrained, the constrained rows sharing
one JSON schema or each with a schema of its own, side by side in one run; and the compile
times of constraints.

Steps: `EngineCore` in this process, `--rows` greedy requests decoding together, their
prompts the named schemas' questions in turn. Five configurations: none constrained; half
(every other row) or all constrained, by one schema of the named set (`--shared-schema`)
or each row by a variant of its prompt's schema (its property names suffixed with the row
number: a grammar and a compile of its own). A configuration runs in segments of
`--steps` timed steps; a row that ends (a complete JSON value ends with "stop") is added
again at once, so the batch stays full. Only steps in which every row decodes one token
are timed (none prefilling, none waiting). Each round runs one segment of every
configuration, the order rotated round by round, so that a slow spell of the machine
falls on all alike. Figures: each configuration's median step, and its ratio to the
unconstrained median (also the median of the per-round ratios, which drift cancels). The
mask fill (every constrained row's mask, on the mask thread beside the forward pass) is
timed per step. Every constrained output that ends must parse as JSON: the count is shown
(a warm-up segment of each configuration, untimed, runs until every row has ended once).

Compiles, before the steps: the llguidance tokenizer (a compiler's start-up); the first
compile of `--compiles` variants of each named schema (an enum; a bounded string and a
number; a nested array with maxItems), of json_object, a regex and a Lark tool-call
grammar, each on a compiler that caches nothing; the same spec again on the engine's
compiler (a cache hit). Each timed as a request waits for it: submitted to the compile
threads and awaited.

Goals (issue 31): every row constrained within 1.1x of the unconstrained step; compile
p99 under 50 ms.

    .venv/bin/python bench/structured.py            # ~4 minutes on 2 cores

Writes structured.json and structured.png into --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.log import log
from common.results import cpu_busy_fraction, format_table, run_and_write
from common.schemas import closed_object
from common.stats import percentile

from tokenfleet import SamplingParams
from tokenfleet.checkpoint.folder import resolve_model_folder
from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.config import CacheConfig, EngineConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.sampling_params import Constraint
from tokenfleet.engine.core import EngineCore
from tokenfleet.models.config import ModelConfig
from tokenfleet.policy.step_model import StepModelConfig
from tokenfleet.runner.grammar import GrammarCompiler

STEP_GOAL = 1.1  # every row constrained, against the unconstrained step
COMPILE_P99_GOAL_S = 0.050
BLOCK_SIZE = 16
PROMPTS = {
    "enum": "Is this review positive or negative? 'I loved this movie!' Answer in JSON.",
    "bounded": "Give a title and a score from 0 to 10 for a movie, as JSON.",
    "nested": "List two fruits with quantities as JSON.",
}
NAMES = list(PROMPTS)
REGEX = r"[0-9]{1,3}"
TOOL_CALL = (
    'start: "<tool_call>" args "</tool_call>"\n'
    'args: %json {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},'
    ' "required": ["city"], "additionalProperties": false}\n'
)


def named_schema(name: str, variant: int | None = None) -> Constraint:
    """A schema of the named set; a variant has its property names suffixed with its number."""
    s = "" if variant is None else f"_{variant}"
    if name == "enum":
        schema = closed_object({f"sentiment{s}": {"enum": ["positive", "negative", "neutral"]}})
    elif name == "bounded":
        schema = closed_object(
            {
                f"title{s}": {"type": "string", "minLength": 1, "maxLength": 20},
                f"score{s}": {"type": "number", "minimum": 0, "maximum": 10},
            }
        )
    else:
        item = closed_object(
            {
                f"name{s}": {"type": "string", "maxLength": 12},
                f"qty{s}": {"type": "integer", "minimum": 1, "maximum": 9},
            }
        )
        schema = closed_object({f"items{s}": {"type": "array", "maxItems": 2, "items": item}})
    return Constraint("json_schema", json.dumps(schema))


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    fraction: float  # of the rows constrained: every other row at 0.5
    distinct: bool  # each constrained row its own schema, or all the shared one


CONFIGS = (
    Config("none", "none", 0.0, False),
    Config("half_shared", "half, one schema", 0.5, False),
    Config("all_shared", "all, one schema", 1.0, False),
    Config("half_distinct", "half, distinct schemas", 0.5, True),
    Config("all_distinct", "all, distinct schemas", 1.0, True),
)


@dataclass
class Segment:
    """What one run of a configuration's rows gave."""

    step_s: list[float] = field(default_factory=list)  # its steady decode steps
    fills: list[tuple[float, int]] = field(default_factory=list)  # theirs: seconds, rows
    json_parsed: int = 0
    json_outputs: int = 0  # constrained outputs that ended (complete, or cut at max_tokens)


@dataclass
class Measured:
    """One configuration's figures over all rounds."""

    step_s: list[float] = field(default_factory=list)
    round_p50_s: list[float] = field(default_factory=list)
    fill_s: list[float] = field(default_factory=list)
    fill_per_row_s: list[float] = field(default_factory=list)  # a fill over its rows
    json_parsed: int = 0
    json_outputs: int = 0

    def add(self, segment: Segment, *, timed: bool = True) -> None:
        self.json_parsed += segment.json_parsed
        self.json_outputs += segment.json_outputs
        if timed:
            self.step_s += segment.step_s
            self.round_p50_s.append(statistics.median(segment.step_s))
            self.fill_s += [s for s, _ in segment.fills]
            self.fill_per_row_s += [s / n for s, n in segment.fills]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--rows", type=int, default=16, help="decode rows in every step")
    add("--rounds", type=int, default=15)
    add("--steps", type=int, default=10, help="timed steps of a configuration in a round")
    add("--max-tokens", type=int, default=64)
    add("--shared-schema", choices=NAMES, default="nested")
    add("--compiles", type=int, default=100, help="first compiles of each kind")
    add("--num-threads", type=int, default=1)
    add("--out", type=Path, default=Path("bench/results"))
    return parser.parse_args(argv)


# -- compiles ----------------------------------------------------------------------------


def _time_compile(compiler: GrammarCompiler, constraint: Constraint) -> float:
    start = time.perf_counter()
    compiler.compile(constraint).result()
    return time.perf_counter() - start


def _summary(what: str, seconds: list[float]) -> dict[str, Any]:
    return {
        "what": what,
        "count": len(seconds),
        "p50_s": percentile(seconds, 50),
        "p99_s": percentile(seconds, 99),
        "max_s": max(seconds),
    }


def compiles(core: EngineCore, args: argparse.Namespace) -> dict[str, Any]:
    vocab, eos = core.model_config.vocab_size, core.model_config.eos_token_ids
    tokenizer_json = core.model_folder / "tokenizer.json"
    tokenizer_s = []
    for _ in range(3):  # a compiler's start-up: it builds llguidance's tokenizer
        start = time.perf_counter()
        GrammarCompiler(tokenizer_json, vocab, eos).close()
        tokenizer_s.append(time.perf_counter() - start)
    fresh = GrammarCompiler(tokenizer_json, vocab, eos, cache_size=0)  # every compile a first
    log(f"llguidance tokenizer: {min(tokenizer_s):.2f}-{max(tokenizer_s):.2f} s")
    assert core.grammar is not None
    first: dict[str, list[float]] = {name: [] for name in NAMES}
    hit: list[float] = []
    for k, name in itertools.product(range(args.compiles), NAMES):
        constraint = named_schema(name, 1000 + k)  # never a step's variant
        first[name].append(_time_compile(fresh, constraint))
        core.grammar.compile(constraint).result()
        hit.append(_time_compile(core.grammar, Constraint("json_schema", constraint.spec)))
    others = {
        "json_object": Constraint("json_object"),
        "regex": Constraint("regex", REGEX),
        "tool call (Lark)": Constraint("grammar", TOOL_CALL),
    }
    other_s = {
        what: [_time_compile(fresh, c) for _ in range(args.compiles)] for what, c in others.items()
    }
    fresh.close()
    named = [s for name in NAMES for s in first[name]]
    rows = [
        _summary("first compile, named schemas", named),
        *(_summary(f"first compile, {name}", first[name]) for name in NAMES),
        _summary("cache hit, named schemas", hit),
        *(_summary(f"first compile, {what}", s) for what, s in other_s.items()),
    ]
    for row in rows:
        log(f"{row['what']}: p50 {row['p50_s'] * 1e3:.2f} ms, p99 {row['p99_s'] * 1e3:.2f} ms")
    worst_p99 = max(r["p99_s"] for r in rows if r["what"].startswith("first"))
    return {"tokenizer_s": tokenizer_s, "rows": rows, "first_compile_p99_max_s": worst_p99}


# -- steps -------------------------------------------------------------------------------


def row_params(config: Config, args: argparse.Namespace) -> list[SamplingParams]:
    """Each row's sampling parameters: greedy; unconstrained rows never stop early."""
    params = []
    for i in range(args.rows):
        constrained = config.fraction == 1.0 or (config.fraction == 0.5 and i % 2 == 0)
        if not constrained:
            params.append(
                SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
            )
            continue
        name = NAMES[i % len(NAMES)]
        constraint = named_schema(name, i) if config.distinct else named_schema(args.shared_schema)
        params.append(
            SamplingParams(max_tokens=args.max_tokens, temperature=0, constraint=constraint)
        )
    return params


def all_decoding(core: EngineCore, num_rows: int) -> bool:
    """Whether the next step is steady decode: every row in the batch, each with one token
    to compute past its prompt, nothing waiting."""
    running = core.scheduler.running
    return (
        len(running) == num_rows
        and core.stats().num_waiting == 0
        and all(
            r.num_computed_tokens >= r.num_prompt_tokens
            and r.num_tokens - r.num_computed_tokens == 1
            for r in running
        )
    )


class Segments:
    """Runs a configuration's segments on one engine: its rows added, stepped until the
    timed steps are done (ended rows added again), then aborted."""

    def __init__(self, core: EngineCore, tokenizer: Tokenizer, prompts: list[list[int]]) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.prompts = prompts
        self._ids = itertools.count()
        # Each mask fill's time and rows, recorded by a wrapper around the matchers' fill.
        self.fills: list[tuple[float, int]] = []
        fill = core.matchers._fill

        def timed_fill(req_ids: list[str], *rest: Any) -> Any:
            start = time.perf_counter()
            result = fill(req_ids, *rest)
            self.fills.append((time.perf_counter() - start, len(req_ids)))
            return result

        core.matchers._fill = timed_fill  # type: ignore[method-assign]

    def run(
        self, params: list[SamplingParams], num_steps: int, *, every_row_ends: bool = False
    ) -> Segment:
        """Row i of `params` on prompt i, stepped until `num_steps` steady decode steps are
        timed (and, with `every_row_ends`, every constrained row has ended once), then
        aborted. A row that ends is added again at once; a constrained one's output checked."""
        core = self.core
        segment = Segment()
        slot_of: dict[str, int] = {}
        tokens: dict[str, list[int]] = {}
        not_ended = {i for i, p in enumerate(params) if every_row_ends and p.constraint}

        def add(slot: int) -> None:
            req_id = f"s{next(self._ids)}"
            core.add_request(
                EngineCoreRequest(req_id, self.prompts[slot], params[slot], time.monotonic())
            )
            slot_of[req_id] = slot
            tokens[req_id] = []

        for slot in range(len(params)):
            add(slot)
        while len(segment.step_s) < num_steps or not_ended:
            steady = all_decoding(core, len(params))
            num_fills = len(self.fills)
            start = time.perf_counter()
            out = core.step()
            seconds = time.perf_counter() - start
            if steady and len(segment.step_s) < num_steps:
                segment.step_s.append(seconds)
                if len(self.fills) > num_fills:
                    segment.fills.append(self.fills[-1])
            for o in out.outputs:
                tokens[o.req_id].extend(o.new_token_ids)
                if not o.finished:
                    continue
                slot = slot_of.pop(o.req_id)
                if params[slot].constraint is not None:
                    text = self.tokenizer.decode(tokens[o.req_id])
                    segment.json_outputs += 1
                    segment.json_parsed += o.finish_reason == "stop" and _parses(text)
                not_ended.discard(slot)
                add(slot)
        core.abort(list(slot_of))
        while core.has_unfinished_requests():
            core.step()
        return segment


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def steps(core: EngineCore, args: argparse.Namespace) -> dict[str, Measured]:
    tokenizer = Tokenizer(core.model_folder)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPTS[NAMES[i % len(NAMES)]]}]
            )
        )
        for i in range(args.rows)
    ]
    params = {c.name: row_params(c, args) for c in CONFIGS}
    segments = Segments(core, tokenizer, prompts)
    measured = {c.name: Measured() for c in CONFIGS}
    # Warm-up, untimed: every schema compiled, every path run, every constrained row's
    # output complete once (the shared schema's outputs outlast a timed segment).
    for config in CONFIGS:
        segment = segments.run(params[config.name], 3, every_row_ends=True)
        measured[config.name].add(segment, timed=False)
    log(
        "warm-up done: "
        + ", ".join(
            f"{c.name} JSON {measured[c.name].json_parsed}/{measured[c.name].json_outputs}"
            for c in CONFIGS[1:]
        )
    )
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
        for config in order:
            measured[config.name].add(segments.run(params[config.name], args.steps))
        log(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(
                f"{c.name} {measured[c.name].round_p50_s[-1] * 1e3:.1f} ms" for c in CONFIGS
            )
        )
    return measured


# -- the run -----------------------------------------------------------------------------


def build_core(args: argparse.Namespace) -> EngineCore:
    """The bundled model's engine with a KV cache for the rows' prompts and outputs."""
    folder = resolve_model_folder(None)
    kv_bytes = ModelConfig.from_folder(folder).kv_bytes_per_token(4)  # float32
    blocks_per_row = (128 + args.max_tokens) // BLOCK_SIZE + 1
    cache = CacheConfig(
        block_size=BLOCK_SIZE,
        kv_cache_memory=kv_bytes * BLOCK_SIZE * 2 * args.rows * blocks_per_row,
    )
    # Steps one after another (no overlap): each step's time is its own.
    config = EngineConfig(
        model=str(folder), num_threads=args.num_threads, cache=cache, overlap=False
    )
    return EngineCore(config, step_model_config=StepModelConfig(profile=False))


def run(args: argparse.Namespace) -> dict[str, Any]:
    busy = cpu_busy_fraction()
    if busy is not None and busy > 0.1:
        log(f"warning: the CPUs are already {busy:.0%} busy; the figures will be noisy")
    core = build_core(args)
    log(f"engine ready: {args.rows} rows, {args.num_threads} torch thread(s)")
    try:
        compile_result = compiles(core, args)
        measured = steps(core, args)
    finally:
        core.matchers.close()
        if core.grammar is not None:
            core.grammar.close()
    none = measured["none"]
    none_p50 = statistics.median(none.step_s)
    configs = []
    for config in CONFIGS:
        m = measured[config.name]
        paired = [a / b for a, b in zip(m.round_p50_s, none.round_p50_s, strict=True)]
        configs.append(
            {
                "name": config.name,
                "label": config.label,
                "constrained_fraction": config.fraction,
                "distinct_schemas": config.distinct,
                "steps": len(m.step_s),
                "step_p50_s": statistics.median(m.step_s),
                "step_p90_s": percentile(m.step_s, 90),
                "ratio": statistics.median(m.step_s) / none_p50,
                "paired_ratio": statistics.median(paired),
                "round_p50_s": m.round_p50_s,
                "fill_p50_s": percentile(m.fill_s, 50),
                "fill_p99_s": percentile(m.fill_s, 99),
                "fill_per_row_p50_s": percentile(m.fill_per_row_s, 50),
                "fill_per_row_p99_s": percentile(m.fill_per_row_s, 99),
                "json_parsed": m.json_parsed,
                "json_outputs": m.json_outputs,
            }
        )
    worst = max(c["ratio"] for c in configs if c["constrained_fraction"] == 1.0)
    result = {
        "cpu_busy_at_start": busy,
        "rows": args.rows,
        "configs": configs,
        "compile": compile_result,
        "goals": {
            "all_constrained_ratio_max": worst,
            "step_goal": STEP_GOAL,
            "step_goal_met": worst <= STEP_GOAL,
            "compile_p99_goal_s": COMPILE_P99_GOAL_S,
            "compile_goal_met": compile_result["first_compile_p99_max_s"] < COMPILE_P99_GOAL_S,
        },
    }
    print_tables(result)
    return result


def _ms(seconds: float) -> str:
    """Milliseconds for a table cell, to three figures or so."""
    digits = 3 if seconds < 1e-3 else 2 if seconds < 0.01 else 1
    return f"{seconds * 1e3:.{digits}f}"


def print_tables(result: dict[str, Any]) -> None:
    lines = [
        [
            "rows constrained",
            "steps",
            "step p50 ms",
            "p90 ms",
            "vs none",
            "paired",
            "fill p50/p99 ms",
            "JSON parsed",
        ]
    ]
    for c in result["configs"]:
        fill = (
            "-"
            if not c["constrained_fraction"]
            else f"{_ms(c['fill_p50_s'])} / {_ms(c['fill_p99_s'])}"
        )
        json_cell = (
            "-" if not c["constrained_fraction"] else f"{c['json_parsed']}/{c['json_outputs']}"
        )
        lines.append(
            [
                c["label"],
                str(c["steps"]),
                _ms(c["step_p50_s"]),
                _ms(c["step_p90_s"]),
                f"{c['ratio']:.2f}x",
                f"{c['paired_ratio']:.2f}x",
                fill,
                json_cell,
            ]
        )
    print(format_table(lines))
    lines = [["compile", "count", "p50 ms", "p99 ms", "max ms"]]
    for row in result["compile"]["rows"]:
        lines.append(
            [
                row["what"],
                str(row["count"]),
                _ms(row["p50_s"]),
                _ms(row["p99_s"]),
                _ms(row["max_s"]),
            ]
        )
    print(format_table(lines))
    tokenizer_s = result["compile"]["tokenizer_s"]
    goals = result["goals"]
    print(
        f"llguidance tokenizer {min(tokenizer_s):.2f}-{max(tokenizer_s):.2f} s. Goals: all rows "
        f"constrained {goals['all_constrained_ratio_max']:.3f}x (<= {STEP_GOAL}x: "
        f"{'met' if goals['step_goal_met'] else 'missed'}); first compile p99 "
        f"{result['compile']['first_compile_p99_max_s'] * 1e3:.2f} ms at most (< 50 ms: "
        f"{'met' if goals['compile_goal_met'] else 'missed'})"
    )


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 5), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.2, 1))
    configs = result["configs"]
    x = range(len(configs))
    p50 = [c["step_p50_s"] * 1e3 for c in configs]
    left.bar(x, p50, color=["grey"] + ["tab:blue"] * (len(configs) - 1), label="p50")
    left.scatter(
        x, [c["step_p90_s"] * 1e3 for c in configs], marker="_", s=400, color="black", label="p90"
    )
    for i, c in enumerate(configs):
        left.annotate(
            f"{c['ratio']:.2f}x",
            (i, p50[i] / 2),
            ha="center",
            color="white",
            fontweight="bold",
        )
    left.axhline(
        p50[0] * STEP_GOAL, linestyle="--", color="tab:red", label=f"goal: {STEP_GOAL}x none"
    )
    left.set_xticks(list(x), [c["label"].replace(", ", "\n") for c in configs], fontsize="small")
    left.set_ylim(0, max(c["step_p90_s"] for c in configs) * 1e3 * 1.25)
    left.set_xlabel("rows constrained")
    left.set_ylabel("decode step, ms")
    left.set_title(f"steady decode steps of {result['rows']} rows (ratio: p50 against none)")
    left.legend(fontsize="small", loc="upper left", ncols=3)
    compile_rows = result["compile"]["rows"]
    y = range(len(compile_rows))
    for offset, key in ((-0.2, "p50"), (0.2, "p99")):
        values = [r[f"{key}_s"] * 1e3 for r in compile_rows]
        right.barh([i + offset for i in y], values, height=0.4, label=key)
    right.axvline(
        COMPILE_P99_GOAL_S * 1e3, linestyle="--", color="tab:red", label="goal: p99 50 ms"
    )
    right.set_yticks(list(y), [r["what"] for r in compile_rows], fontsize="small")
    right.invert_yaxis()
    right.set_xscale("log")
    right.set_xlabel("ms, submitted to the compile threads and awaited")
    right.set_title("compiles")
    right.legend(fontsize="small", loc="lower right")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    run_and_write(parse_args(argv), "structured", run, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
