"""Offline throughput: tokenfleet's continuous batching against transformers' static batches.

Both systems serve the same randomly drawn requests (fixed seed) with greedy decoding in
float32 at the same thread count, and every request must produce exactly its drawn number
of output tokens. The script measures:

* the machine's own float32 compute limit: a large matrix product, in GFLOP/s;
* tokenfleet: output tokens/s over the whole run and over the steps where `max_num_seqs`
  requests run at once (the headline "at 64 concurrent requests" figure), the achieved
  FLOP/s and its share of the matmul limit, and a per-step timeline;
* transformers `generate` on static batches of `max_num_seqs` requests in arrival order,
  left-padded, counting only each request's own output tokens as useful.

Achieved FLOP/s counts the work the requests need, whatever a system actually spends:
per processed token, 2 FLOPs per parameter of the decoder body plus attention
(4 x layers x heads x head_dim x context length); the LM head (2 x vocab x hidden) only
for tokens whose logits are sampled (one per output token), as both systems skip it for
the rest of the prompt. A request of P prompt and O output tokens processes P + O - 1
tokens: its last output token is sampled but never fed back. Padding, recomputation after
preemption and wasted decode steps are not counted, so a system that wastes work scores
lower.

    .venv/bin/python bench/offline_throughput.py                  # the full benchmark
    .venv/bin/python bench/offline_throughput.py --num-requests 12 --max-num-seqs 6 \\
        --max-prompt-len 128 --max-output-len 32 --out /tmp/bench  # a quick check

Writes `offline_throughput.json` and `offline_throughput.png` into --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common.results import BUSY_WARNING, args_json, cpu_busy_fraction, format_table, machine_info
from tqdm import tqdm

from tokenfleet import LLM, SamplingParams, envs
from tokenfleet.checkpoint.bundled import prepare_bundled_model
from tokenfleet.config import CacheConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.models.config import ModelConfig
from tokenfleet.runner.model_runner import ModelRunner, StepInputs

# SmolLM2's special tokens are ids 0..16; random prompts use only ordinary tokens.
FIRST_ORDINARY_TOKEN_ID = 17
DTYPE_SIZE = 4  # float32
MAX_NUM_BATCHED_TOKENS = 512
RESULT_NAME = "offline_throughput"
GOAL_RATIO_VS_TRANSFORMERS = 3.0
GOAL_FRACTION_OF_MATMUL = 0.5


# -- workload ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def draw_requests(
    num_requests: int,
    seed: int,
    vocab_size: int,
    prompt_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
) -> list[BenchRequest]:
    """Prompt and output lengths uniform in their inclusive ranges, prompt ids uniform."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_len_range[0], prompt_len_range[1] + 1, num_requests)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, num_requests)
    return [
        BenchRequest(rng.integers(FIRST_ORDINARY_TOKEN_ID, vocab_size, int(p)).tolist(), int(o))
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


# -- FLOP accounting ---------------------------------------------------------------------


def context_sum(start_pos: int, num_tokens: int, window: int | None) -> int:
    """Sum of the attention context lengths of the tokens at start_pos .. +num_tokens-1.

    The token at position p attends to p + 1 tokens (itself included), at most `window`.
    """
    first, last = start_pos + 1, start_pos + num_tokens
    if window is None or last <= window:
        return (first + last) * num_tokens // 2
    if first > window:
        return window * num_tokens
    return (first + window) * (window - first + 1) // 2 + window * (last - window)


@dataclass(frozen=True)
class FlopModel:
    """FLOPs a Llama-family forward pass needs, per the convention in the module docstring."""

    body_flops_per_token: int  # 2 x parameters of the decoder layers
    head_flops_per_sample: int  # 2 x vocab x hidden: the LM head, for sampled tokens only
    attn_flops_per_context_token: int  # 4 x layers x heads x head_dim
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: ModelConfig) -> FlopModel:
        head_params = config.vocab_size * config.hidden_size
        return cls(
            body_flops_per_token=2 * (config.num_params - head_params),
            head_flops_per_sample=2 * head_params,
            attn_flops_per_context_token=4 * config.num_layers * config.num_heads * config.head_dim,
            sliding_window=config.sliding_window,
        )

    def chunk(self, start_pos: int, num_tokens: int, num_samples: int) -> int:
        """A run of consecutive tokens of one sequence, `num_samples` of them sampled."""
        return (
            self.body_flops_per_token * num_tokens
            + self.attn_flops_per_context_token
            * context_sum(start_pos, num_tokens, self.sliding_window)
            + self.head_flops_per_sample * num_samples
        )

    def request(self, prompt_len: int, output_len: int) -> int:
        return self.chunk(0, prompt_len + output_len - 1, output_len)

    def workload(self, requests: Sequence[BenchRequest]) -> int:
        return sum(self.request(len(r.prompt_token_ids), r.output_len) for r in requests)


# -- the machine's compute limit ---------------------------------------------------------


@dataclass(frozen=True)
class MatmulResult:
    size: int
    repeats: int
    seconds: list[float]
    gflops: float  # from the median time


def measure_matmul(size: int, repeats: int = 7, warmup: int = 2) -> MatmulResult:
    """float32 (size x size) @ (size x size) at the current torch thread count."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    out = torch.empty(size, size)
    seconds = []
    for i in tqdm(range(warmup + repeats), desc="matmul", unit="run", leave=False):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return MatmulResult(size, repeats, seconds, 2 * size**3 / median / 1e9)


# -- results -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    """Output tokens and useful FLOPs over some stretch of wall time."""

    seconds: float
    output_tokens: int
    flops: int
    matmul_gflops: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9

    @property
    def fraction_of_matmul(self) -> float:
        return self.gflops / self.matmul_gflops

    def to_json(self) -> dict[str, float]:
        return {
            "seconds": self.seconds,
            "output_tokens": self.output_tokens,
            "flops": self.flops,
            "output_tokens_per_s": self.tokens_per_s,
            "achieved_gflops": self.gflops,
            "fraction_of_matmul_limit": self.fraction_of_matmul,
        }


@dataclass(frozen=True)
class StepRecord:
    start_s: float  # since the first request was added
    end_s: float
    num_scheduled: int  # requests that advanced in this step
    num_running: int  # running after the step (finished ones gone)
    num_waiting: int
    new_tokens: int  # output tokens sampled
    processed_tokens: int  # tokens fed through the model
    flops: int  # by FlopModel, for exactly the tokens this step processed


@dataclass
class TokenfleetResult:
    overall: Throughput
    full_concurrency: Throughput | None  # steps with max_num_seqs requests scheduled
    steps: list[StepRecord]
    num_preemptions: int
    kv_cache_bytes: int
    load_s: float
    warmup_s: float


@dataclass
class TransformersResult:
    overall: Throughput
    batches: list[dict[str, Any]] = field(default_factory=list)
    load_s: float = 0.0
    warmup_s: float = 0.0


# -- tokenfleet --------------------------------------------------------------------------


class StepRecorder:
    """Wraps a ModelRunner's prepare so the benchmark sees each step's SchedulerOutput, in
    launch order. With the overlap a step() call launches the next step before it returns
    the current one: `take` gives the oldest launched step whose forward has ended."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self._prepare = runner.prepare
        self._launched: deque[SchedulerOutput] = deque()

    def __call__(self, scheduler_output: SchedulerOutput) -> StepInputs:
        self._launched.append(scheduler_output)
        return self._prepare(scheduler_output)

    def take(self, in_flight: bool) -> SchedulerOutput | None:
        """After a step() call: the step it ran (None if it ran none); `in_flight`: a step
        launched by that call still runs."""
        if len(self._launched) > int(in_flight):
            return self._launched.popleft()
        return None

    def __enter__(self) -> StepRecorder:
        self._runner.prepare = self  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._runner.prepare  # the class's method shows through again


def kv_cache_budget(config: ModelConfig, max_num_seqs: int, max_seq_len: int) -> int:
    """Bytes of KV cache for max_num_seqs requests of max_seq_len tokens, whole blocks."""
    block_size = CacheConfig().block_size
    blocks_per_seq = math.ceil(max_seq_len / block_size)
    return max_num_seqs * blocks_per_seq * block_size * config.kv_bytes_per_token(DTYPE_SIZE)


def warmup_prompts(count: int, length: int) -> list[list[int]]:
    return [
        [FIRST_ORDINARY_TOKEN_ID + (7 * i + j) % 1000 for j in range(length)] for i in range(count)
    ]


def run_tokenfleet(
    folder: Path,
    requests: Sequence[BenchRequest],
    *,
    threads: int,
    max_num_seqs: int,
    max_seq_len: int,
    flop_model: FlopModel,
    matmul_gflops: float,
    overlap: bool | None = None,
) -> TokenfleetResult:
    """Continuous batching, driving EngineCore step by step to record each step."""
    config = ModelConfig.from_folder(folder)
    start = time.perf_counter()
    llm = LLM(
        str(folder),
        num_threads=threads,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        kv_cache_memory=kv_cache_budget(config, max_num_seqs, max_seq_len),
        overlap=overlap,
    )
    load_s = time.perf_counter() - start

    start = time.perf_counter()
    llm.generate(warmup_prompts(2, 24), SamplingParams(max_tokens=4, temperature=0))
    warmup_s = time.perf_counter() - start

    engine = llm.engine
    preemptions_before = engine.stats().num_preemptions
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    finish_reasons: dict[str, str | None] = {}
    steps: list[StepRecord] = []
    bar = tqdm(
        total=sum(r.output_len for r in requests), desc="tokenfleet", unit="tok", smoothing=0.1
    )
    with StepRecorder(engine.runner) as recorder:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            params = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
            engine.add_request(
                EngineCoreRequest(str(i), r.prompt_token_ids, params, time.monotonic())
            )
        while engine.has_unfinished_requests():
            step_start = time.perf_counter() - t0
            out = engine.step()
            step_end = time.perf_counter() - t0
            new_tokens = 0
            for o in out.outputs:
                tokens[o.req_id].extend(o.new_token_ids)
                new_tokens += len(o.new_token_ids)
                if o.finished:
                    finish_reasons[o.req_id] = o.finish_reason
            ran = recorder.take(engine.step_in_flight)
            scheduled = ran.scheduled if ran else []
            assert out.stats is not None
            steps.append(
                StepRecord(
                    start_s=step_start,
                    end_s=step_end,
                    num_scheduled=len(scheduled),
                    num_running=out.stats.num_running,
                    num_waiting=out.stats.num_waiting,
                    new_tokens=new_tokens,
                    processed_tokens=sum(s.num_tokens for s in scheduled),
                    flops=sum(
                        flop_model.chunk(s.start_pos, s.num_tokens, int(s.sample))
                        for s in scheduled
                    ),
                )
            )
            bar.update(new_tokens)
        wall_s = time.perf_counter() - t0
    bar.close()

    for i, r in enumerate(requests):
        got, reason = len(tokens[str(i)]), finish_reasons.get(str(i))
        if got != r.output_len or reason != "length":
            raise RuntimeError(
                f"request {i}: {got} tokens ({reason}), wanted {r.output_len} (length)"
            )

    overall = Throughput(
        wall_s, sum(r.output_len for r in requests), flop_model.workload(requests), matmul_gflops
    )
    full = [s for s in steps if s.num_scheduled >= max_num_seqs]
    full_concurrency = (
        Throughput(
            sum(s.end_s - s.start_s for s in full),
            sum(s.new_tokens for s in full),
            sum(s.flops for s in full),
            matmul_gflops,
        )
        if full
        else None
    )
    result = TokenfleetResult(
        overall=overall,
        full_concurrency=full_concurrency,
        steps=steps,
        num_preemptions=engine.stats().num_preemptions - preemptions_before,
        kv_cache_bytes=engine.runner.kv_cache_bytes,
        load_s=load_s,
        warmup_s=warmup_s,
    )
    del llm, engine
    gc.collect()  # hand the KV cache back before transformers loads
    return result


# -- transformers ------------------------------------------------------------------------


def progress_criteria(bar: tqdm) -> Any:
    """A transformers StoppingCriteria that never stops, ticking `bar` once per step."""
    from transformers import StoppingCriteria

    class ProgressCriteria(StoppingCriteria):
        def __call__(
            self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any
        ) -> torch.BoolTensor:
            bar.update(1)
            return torch.zeros(  # type: ignore[return-value]
                input_ids.shape[0], dtype=torch.bool, device=input_ids.device
            )

    return ProgressCriteria()


def hf_generate_batch(
    model: Any, pad_id: int, batch: Sequence[BenchRequest], bar: tqdm | None
) -> tuple[int, int]:
    """One static batch, left-padded, every row forced to the batch's longest output.

    Returns (padded prompt length, new tokens per row).
    """
    from transformers import StoppingCriteriaList

    pad_len = max(len(r.prompt_token_ids) for r in batch)
    new_tokens = max(r.output_len for r in batch)
    input_ids = torch.full((len(batch), pad_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), pad_len), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        input_ids[row, pad_len - n :] = torch.tensor(r.prompt_token_ids)
        attention_mask[row, pad_len - n :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # EOS suppressed, so no row ends early
            do_sample=False,
            pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([progress_criteria(bar)]) if bar else None,
        )
    if tuple(out.shape) != (len(batch), pad_len + new_tokens):
        raise RuntimeError(f"transformers returned {tuple(out.shape)} for {len(batch)} rows")
    return pad_len, new_tokens


def run_transformers(
    folder: Path,
    requests: Sequence[BenchRequest],
    *,
    batch_size: int,
    flop_model: FlopModel,
    matmul_gflops: float,
) -> TransformersResult:
    """Static batches of `batch_size` requests in arrival order, one after another."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
    pad_id = int(pad[0] if isinstance(pad, list) else pad)

    start = time.perf_counter()
    hf_generate_batch(model, pad_id, [BenchRequest(p, 4) for p in warmup_prompts(2, 24)], None)
    warmup_s = time.perf_counter() - start

    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    records = []
    bar = tqdm(
        total=sum(max(r.output_len for r in b) for b in batches), desc="transformers", unit="step"
    )
    t0 = time.perf_counter()
    for batch in batches:
        batch_start = time.perf_counter()
        pad_len, new_tokens = hf_generate_batch(model, pad_id, batch, bar)
        records.append(
            {
                "num_requests": len(batch),
                "padded_prompt_len": pad_len,
                "new_tokens_per_row": new_tokens,
                "useful_output_tokens": sum(r.output_len for r in batch),
                "seconds": time.perf_counter() - batch_start,
            }
        )
    wall_s = time.perf_counter() - t0
    bar.close()
    overall = Throughput(
        wall_s, sum(r.output_len for r in requests), flop_model.workload(requests), matmul_gflops
    )
    return TransformersResult(overall, records, load_s, warmup_s)


# -- reporting ---------------------------------------------------------------------------


def timeline(steps: Sequence[StepRecord], num_bins: int = 50) -> dict[str, list[float]]:
    """Output tokens/s in equal time bins (each step's tokens land at its end time)."""
    if not steps:
        return {"bin_end_s": [], "output_tokens_per_s": []}
    wall = steps[-1].end_s
    durations = sorted(s.end_s - s.start_s for s in steps)
    # At least a few steps per bin, or the rate is a comb of step-sized spikes.
    width = max(wall / num_bins, 3 * durations[len(durations) // 2])
    counts = [0] * max(1, math.ceil(wall / width))
    for s in steps:
        counts[min(int(s.end_s / width), len(counts) - 1)] += s.new_tokens
    last_width = wall - width * (len(counts) - 1)
    widths = [width] * (len(counts) - 1) + [last_width if last_width > 0 else width]
    ends = [min((i + 1) * width, wall) for i in range(len(counts))]
    return {
        "bin_end_s": ends,
        "output_tokens_per_s": [c / w for c, w in zip(counts, widths, strict=True)],
    }


def plot(
    path: Path,
    bars: list[tuple[str, float]],
    steps: Sequence[StepRecord],
    binned: dict[str, list[float]],
    max_num_seqs: int,
) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 2])

    names = [name for name, _ in bars]
    values = [value for _, value in bars]
    colors = ["tab:blue" if name.startswith("tokenfleet") else "tab:gray" for name in names]
    rects = left.bar(range(len(bars)), values, color=colors)
    left.bar_label(rects, fmt="%.1f")
    left.set_xticks(range(len(bars)), names, rotation=15, ha="right")
    left.set_ylabel("output tokens/s")
    left.set_title("Offline throughput")

    ends = binned["bin_end_s"]
    starts = [0.0, *ends[:-1]]
    right.stairs(binned["output_tokens_per_s"], [*starts[:1], *ends], color="tab:blue")
    right.set_xlabel("seconds since the first request")
    right.set_ylabel("output tokens/s", color="tab:blue")
    right.set_title("tokenfleet over time")
    twin = right.twinx()
    if steps:
        twin.stairs(
            [s.num_scheduled for s in steps],
            [steps[0].start_s, *(s.end_s for s in steps)],
            baseline=None,
            color="tab:orange",
            alpha=0.8,
        )
    twin.set_ylabel("requests scheduled per step", color="tab:orange")
    twin.set_ylim(0, max_num_seqs * 1.1)
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path, dpi=120)


def table_row(name: str, t: Throughput, reference: Throughput | None) -> list[str]:
    ratio = f"{t.tokens_per_s / reference.tokens_per_s:.2f}x" if reference else "-"
    return [
        name,
        f"{t.tokens_per_s:.1f}",
        f"{t.seconds:.1f}",
        f"{t.gflops:.1f}",
        f"{100 * t.fraction_of_matmul:.1f}%",
        ratio,
    ]


# -- main --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default=None, help="Hugging Face model folder; none: the bundled model")
    add("--num-requests", type=int, default=128, help="requests drawn")
    add("--threads", type=int, default=2, help="torch threads, the same for every system")
    add("--max-num-seqs", type=int, default=64, help="tokenfleet's and transformers' batch")
    add("--seed", type=int, default=0, help="seed of the request draw")
    add("--min-prompt-len", type=int, default=16, help="prompt lengths: lowest")
    add("--max-prompt-len", type=int, default=1024, help="prompt lengths: highest")
    add("--min-output-len", type=int, default=16, help="output lengths: lowest")
    add("--max-output-len", type=int, default=256, help="output lengths: highest")
    add("--matmul-size", type=int, default=2048, help="side of the matrices of the matmul")
    add("--skip-transformers", action="store_true", help="run tokenfleet only")
    add(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="tokenfleet's overlap (the next step planned during the forward; auto: off "
        "when the torch threads take every core)",
    )
    add("--out", type=Path, default=Path("bench/results"), help="folder for JSON and PNG")
    args = parser.parse_args(argv)
    for low, high in (("min_prompt_len", "max_prompt_len"), ("min_output_len", "max_output_len")):
        if not 1 <= getattr(args, low) <= getattr(args, high):
            parser.error(f"need 1 <= --{low.replace('_', '-')} <= --{high.replace('_', '-')}")
    for name in ("num_requests", "threads", "max_num_seqs", "matmul_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    busy_before = cpu_busy_fraction()
    if busy_before is not None and busy_before > BUSY_WARNING:
        print(
            f"warning: {100 * busy_before:.0f}% of the CPUs are busy before the benchmark "
            "starts; other processes will distort every figure (threads oversubscribed)",
            file=sys.stderr,
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder; never reach for the Hub
    torch.set_num_threads(args.threads)
    folder = Path(args.model) if args.model else prepare_bundled_model(envs.cache_dir() / "models")
    config = ModelConfig.from_folder(folder)
    flop_model = FlopModel.from_config(config)
    requests = draw_requests(
        args.num_requests,
        args.seed,
        config.vocab_size,
        (args.min_prompt_len, args.max_prompt_len),
        (args.min_output_len, args.max_output_len),
    )
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    print(
        f"{len(requests)} requests: {prompt_tokens} prompt + {output_tokens} output tokens, "
        f"{flop_model.workload(requests) / 1e12:.2f} TFLOP; model {folder.name} "
        f"({config.num_params / 1e6:.1f}M params touched per token), {args.threads} threads"
    )

    matmul = measure_matmul(args.matmul_size)
    print(f"matmul limit: {matmul.gflops:.1f} GFLOP/s ({args.matmul_size}^3 float32, median)")

    tf = run_tokenfleet(
        folder,
        requests,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_seq_len=args.max_prompt_len + args.max_output_len,
        flop_model=flop_model,
        matmul_gflops=matmul.gflops,
        overlap={"auto": None, "on": True, "off": False}[args.overlap],
    )
    hf = (
        None
        if args.skip_transformers
        else run_transformers(
            folder,
            requests,
            batch_size=args.max_num_seqs,
            flop_model=flop_model,
            matmul_gflops=matmul.gflops,
        )
    )
    reference = hf.overall if hf else None

    full_name = f"tokenfleet @ {args.max_num_seqs} concurrent"
    rows = [["system", "output tok/s", "wall s", "GFLOP/s", "% matmul", "vs transformers"]]
    rows.append(table_row("tokenfleet", tf.overall, reference))
    if tf.full_concurrency:
        rows.append(table_row(full_name, tf.full_concurrency, reference))
    if hf:
        rows.append(
            table_row(f"transformers (static batch {args.max_num_seqs})", hf.overall, hf.overall)
        )
    print()
    print(format_table(rows))
    print(f"matmul limit {matmul.gflops:.1f} GFLOP/s; tokenfleet preemptions: {tf.num_preemptions}")

    goals: dict[str, Any] = {}
    if hf:
        ratio = tf.overall.tokens_per_s / hf.overall.tokens_per_s
        goals["ratio_vs_transformers"] = {
            "value": ratio,
            "goal": GOAL_RATIO_VS_TRANSFORMERS,
            "met": ratio >= GOAL_RATIO_VS_TRANSFORMERS,
        }
    if tf.full_concurrency:
        fraction = tf.full_concurrency.fraction_of_matmul
        goals["fraction_of_matmul_at_full_concurrency"] = {
            "value": fraction,
            "goal": GOAL_FRACTION_OF_MATMUL,
            "met": fraction >= GOAL_FRACTION_OF_MATMUL,
        }
    for name, goal in goals.items():
        verdict = "met" if goal["met"] else "NOT met"
        print(f"goal {name}: {goal['value']:.2f} (goal {goal['goal']}) -> {verdict}")

    binned = timeline(tf.steps)
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {
            **machine_info(args.threads),
            "cpu_busy_before": busy_before,
            "load_average_after": os.getloadavg(),
        },
        "args": args_json(args),
        "model": {
            "folder": str(folder),
            "num_params": config.num_params,
            "num_layers": config.num_layers,
            "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "dtype": "float32",
        },
        "workload": {
            "num_requests": len(requests),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "processed_tokens": prompt_tokens + output_tokens - len(requests),
            "flops": flop_model.workload(requests),
            "flop_model": asdict(flop_model),
            "prompt_lens": [len(r.prompt_token_ids) for r in requests],
            "output_lens": [r.output_len for r in requests],
        },
        "matmul": asdict(matmul),
        "systems": {
            "tokenfleet": {
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "kv_cache_bytes": tf.kv_cache_bytes,
                "load_s": tf.load_s,
                "warmup_s": tf.warmup_s,
                "num_steps": len(tf.steps),
                "num_preemptions": tf.num_preemptions,
                "processed_flops": sum(s.flops for s in tf.steps),
                "overall": tf.overall.to_json(),
                "full_concurrency": (
                    tf.full_concurrency.to_json() if tf.full_concurrency else None
                ),
                "timeline": binned,
                "steps": [asdict(s) for s in tf.steps],
            },
            "transformers": (
                {
                    "batch_size": args.max_num_seqs,
                    "load_s": hf.load_s,
                    "warmup_s": hf.warmup_s,
                    "overall": hf.overall.to_json(),
                    "batches": hf.batches,
                }
                if hf
                else None
            ),
        },
        "goals": goals,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{RESULT_NAME}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    bars = [("tokenfleet", tf.overall.tokens_per_s)]
    if tf.full_concurrency:
        bars.append((full_name, tf.full_concurrency.tokens_per_s))
    if hf:
        bars.append((f"transformers (batch {args.max_num_seqs})", hf.overall.tokens_per_s))
    png_path = args.out / f"{RESULT_NAME}.png"
    plot(png_path, bars, tf.steps, binned, args.max_num_seqs)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
