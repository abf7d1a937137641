"""A prepared accelerator check (issue 32): tokenfleet's own `EngineCore` and Llama code
on a Llama-3-8B-shaped model with random weights in bfloat16, decode steps of 1, 64 and
256 sequences each with a `--context`-token context, each step against the HBM roofline
((weight bytes + KV bytes read) / bandwidth), and the share of the step the device waits
for the engine.

The weights are drawn on the device (never downloaded, never written to disk): the model
folder holds a config.json alone, and the runner's loader is swapped, while the engine is
built, for one that fills the parameters with random values (`random_model`). Per batch
size: the prompts prefill (random token ids, no prefix cache), then `--warmup-steps`
decode steps, then `--steps` timed ones, every sequence decoding one token; the requests
are then aborted. They come as batch requests under the engine's default policy: steps
filled throughout, no prompt cut to keep streams within a TPOT target, so that the
prefill's length is bounded by the token budget alone. Per step: its wall time
(`EngineCore.step`, which ends with the sampled tokens on the host), the host's time
inside the model's forward, and on CUDA the forward's span on the device (events at its
start and end). Last, the forward of the last step again, queued behind a device sleep
longer than the host takes to issue it, so that its time is the kernels' alone, without
launch gaps. On the CPU the three forward figures are one (the forward runs as it is
called). Shares of the step's wall time:

    engine: step - forward span     the device idle while the engine schedules, builds
                                    inputs, samples and writes outputs (the sampler's
                                    own few kernels counted here)
    launch: forward span - kernels  the device idle inside the forward, waiting on the
                                    host to launch the next kernel
    busy:   kernels                 the forward's own work

    .venv/bin/python bench/gpu_check.py                       # one CUDA GPU (H200 defaults)
    .venv/bin/python bench/gpu_check.py --device cpu --tiny   # a tiny shape, seconds

Writes gpu_check.json and gpu_check.png into --out. Bounded: rows that would not fit the
device's memory are skipped, as are those left when --time-limit-s has passed (420 s: the
whole run within 10 minutes on one GPU), and an out-of-memory error ends its row and the
run, each with the reason in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from common.log import log
from common.results import format_table, run_and_write

from tokenfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.request import PRIORITY_BATCH
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.engine.core import EngineCore
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.llama import LlamaForCausalLM
from tokenfleet.policy.step_model import StepModelConfig
from tokenfleet.runner import model_runner

# Meta-Llama-3-8B's config.json, as far as the engine reads it.
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# The same architecture at a size the CPU runs in seconds (the test suite's).
TINY = LLAMA3_8B | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
H200_BANDWIDTH_GBS = 4800.0  # HBM3e, the data sheet's figure
BLOCK = 16
SPARE_BLOCKS = 2  # per sequence, beyond its prompt and the decode tokens it may reach
GIB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--device", default="cuda")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add("--tiny", action="store_true", help="a tiny model of the same architecture")
    add("--seqs", type=int, nargs="+", default=[1, 64, 256])
    add("--context", type=int, help="prompt tokens per sequence (1024; --tiny 64)")
    add("--warmup-steps", type=int, default=3)
    add("--steps", type=int, default=20, help="timed decode steps per batch size")
    add("--replays", type=int, default=5, help="forwards queued behind a sleep (CUDA)")
    add("--max-num-batched-tokens", type=int, default=8192)
    add("--scheduling-policy", default="priority", choices=("priority", "fcfs"))
    add(
        "--bandwidth-gbs",
        type=float,
        help="the roofline's (CUDA: 4800, an H200's HBM3e; CPU: the measured copy's)",
    )
    add("--copy-mib", type=int, help="the measured copy's size (4096; CPU 256; --tiny 64)")
    add("--time-limit-s", type=float, default=420, help="no new batch size after this")
    add("--num-threads", type=int, default=None)
    add(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="the engine's overlap (auto: off for the model on CUDA): the step after the "
        "current one planned during its forward",
    )
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if args.context is None:
        args.context = 64 if args.tiny else 1024
    if args.copy_mib is None:
        args.copy_mib = 64 if args.tiny else (4096 if args.device.startswith("cuda") else 256)
    if min(args.seqs) < 1 or args.context < 1 or args.steps < 1 or args.warmup_steps < 0:
        parser.error("--seqs, --context and --steps must be at least 1, --warmup-steps 0")
    return args


# -- the model -------------------------------------------------------------------------------


def random_model(
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    use_kernel: bool = True,
    linear_backend: str = "auto",
) -> LlamaForCausalLM:
    """`models.loader.load_model`'s stand-in: the folder's config.json, the parameters
    allocated once on the device in `dtype` and drawn there (N(0, 1/fan_in), norms 1)."""
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, use_kernel)
    model.to(dtype)  # on meta: free, and to_empty then allocates in dtype
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms' weights, biases
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
    model.eval()
    model.tune_products(linear_backend)
    model.use_fused(use_kernel)
    return model


@contextlib.contextmanager
def random_weights() -> Iterator[None]:
    """The runner builds its model with `random_model` meanwhile."""
    saved = model_runner.load_model
    model_runner.load_model = random_model
    try:
        yield
    finally:
        model_runner.load_model = saved


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights a step reads: all but the embedding, of which it reads a row per
    token (unless tied: then the LM head reads it whole)."""
    tied = model.config.tie_word_embeddings
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if tied or not name.startswith("embed_tokens")
    )


# -- the device --------------------------------------------------------------------------------


class Device:
    """Synchronising and timing on CUDA or the CPU alike."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def event(self) -> Any:
        """A recorded CUDA event (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def free_bytes(self) -> int | None:
        return int(torch.cuda.mem_get_info(self.device)[0]) if self.cuda else None

    def describe(self) -> dict[str, Any]:
        if not self.cuda:
            return {"type": "cpu"}
        props = torch.cuda.get_device_properties(self.device)
        return {
            "type": "cuda",
            "name": props.name,
            "memory_gib": round(props.total_memory / GIB, 1),
            "cuda": torch.version.cuda,
        }


def copy_bandwidth(dev: Device, nbytes: int, repeats: int = 5) -> float:
    """Bytes a second a device-to-device copy moves (read + write), the best of `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    dev.sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        dev.sync()
        best = min(best, time.perf_counter() - start)
    del src, dst
    if dev.cuda:
        torch.cuda.empty_cache()
    return 2 * nbytes / best


class ForwardTimer:
    """Hooks on the model's forward: per call, the host's time inside it and (CUDA) the
    device's span from its first to its last kernel; the latest call's arguments, for
    replaying it."""

    def __init__(self, model: LlamaForCausalLM, dev: Device) -> None:
        self.dev = dev
        self.last_args: tuple[Any, ...] = ()
        self._calls: list[tuple[float, Any, Any]] = []
        self._start: tuple[float, Any] = (0.0, None)
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def _before(self, module: Any, args: tuple[Any, ...]) -> None:
        self.last_args = args
        self._start = (time.perf_counter(), self.dev.event())

    def _after(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        began, event = self._start
        self._calls.append((time.perf_counter() - began, event, self.dev.event()))

    def take(self) -> tuple[float, float] | None:
        """(host seconds, span seconds) of the oldest forward not taken yet, None if there
        is none: called after each step, whose sampled tokens synchronised the device.
        Oldest, not latest: with the engine's overlap the next step's forward may end
        before this is called."""
        if not self._calls:
            return None
        host_s, start, end = self._calls.pop(0)
        return host_s, (start.elapsed_time(end) / 1e3 if self.dev.cuda else host_s)

    def clear(self) -> None:
        self._calls = []


def kernel_time(run: Callable[[], Any], host_s: float, repeats: int) -> dict[str, Any]:
    """`run`'s time on the CUDA device without launch gaps: queued whole behind a device
    sleep (`torch.cuda._sleep`) longer than the host takes to issue it (`host_s`).
    `queued_whole`: the host issued it all within the sleep every time."""
    sleep = torch.cuda._sleep
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    sleep(10**7)
    end.record()
    end.synchronize()
    cycles_per_s = 1e7 / (start.elapsed_time(end) / 1e3)
    sleep_s = 2 * host_s + 0.005
    times, whole = [], True
    for _ in range(repeats):
        sleep(int(cycles_per_s * sleep_s))
        start.record()
        issued = time.perf_counter()
        run()
        whole = whole and time.perf_counter() - issued < sleep_s
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return {"kernels_s": statistics.median(times), "queued_whole": whole}


# -- the run ---------------------------------------------------------------------------------------


def decode_budget(n: int, args: argparse.Namespace) -> int:
    """Tokens each of n requests may generate: the steps its prompt's batch takes to
    prefill (the first requests decode meanwhile), the warm-up and timed steps, a margin."""
    per_step = max(1, args.max_num_batched_tokens - n)
    return -(-n * args.context // per_step) + args.warmup_steps + args.steps + 8


def seq_blocks(n: int, args: argparse.Namespace) -> int:
    return -(-(args.context + decode_budget(n, args)) // BLOCK) + SPARE_BLOCKS


def row_memory(n: int, args: argparse.Namespace, config: ModelConfig, itemsize: int) -> int:
    """The KV cache n sequences need, plus what a step's activations may take: the decode
    path's gathered copy of one layer's K and V, a prefill step's MLP, the logits."""
    kv_token = config.kv_bytes_per_token(itemsize)
    tokens = n * seq_blocks(n, args) * BLOCK
    gathered = 2 * tokens * kv_token // config.num_layers
    prefill = args.max_num_batched_tokens * 4 * config.intermediate_size * itemsize
    return tokens * kv_token + 2 * gathered + prefill + n * config.vocab_size * 4 + GIB


def decode_row(
    core: EngineCore,
    timer: ForwardTimer,
    dev: Device,
    n: int,
    args: argparse.Namespace,
    t0: float,
    bandwidths: tuple[float, float],
) -> dict[str, Any]:
    """n requests prefilled, then decode steps timed (`time_decodes`); the requests
    aborted after, whatever happened."""
    gen = torch.Generator().manual_seed(n)
    params = SamplingParams(max_tokens=decode_budget(n, args), temperature=0, ignore_eos=True)
    ids = [f"s{n}-{i}" for i in range(n)]
    for req_id in ids:
        prompt = torch.randint(0, core.model_config.vocab_size, (args.context,), generator=gen)
        core.add_request(
            EngineCoreRequest(req_id, prompt.tolist(), params, time.monotonic(), PRIORITY_BATCH)
        )
    try:
        row = time_decodes(core, timer, dev, n, args, t0, bandwidths)
    except BaseException:
        with contextlib.suppress(Exception):  # the row's own error is the one to report
            end_requests(core, timer, ids)
        raise
    end_requests(core, timer, ids)
    return row


def end_requests(core: EngineCore, timer: ForwardTimer, ids: list[str]) -> None:
    core.abort(ids)
    while core.has_unfinished_requests() or core.step_in_flight:  # the aborts' outputs
        core.step()
    timer.clear()


def time_decodes(
    core: EngineCore,
    timer: ForwardTimer,
    dev: Device,
    n: int,
    args: argparse.Namespace,
    t0: float,
    bandwidths: tuple[float, float],
) -> dict[str, Any]:
    """Steps until `args.steps` decode steps of all n sequences are timed after the
    warm-up; the last one's forward replayed for its kernels' time (CUDA)."""
    scheduler = core.scheduler
    steps: list[dict[str, float]] = []
    prefill_steps, decode_steps = 0, 0
    began = time.perf_counter()
    while len(steps) < args.steps and core.has_unfinished_requests():
        # One token to go each, with or without the overlap (there, the step this call
        # returns is already planned, and the one planned now decodes the token it gives).
        decoding = not len(scheduler.waiting) and len(scheduler.running) == n
        decoding = decoding and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in scheduler.running
        )
        context = sum(r.num_computed_tokens + 1 for r in scheduler.running)
        if not decoding and time.monotonic() - t0 > args.time_limit_s:
            return {"seqs": n, "skipped": f"time limit reached while prefilling {n}"}
        start = time.perf_counter()
        out = core.step()
        wall = time.perf_counter() - start
        forward = timer.take()
        if not decoding:
            prefill_steps += 1
            continue
        if len(out.outputs) != n or forward is None:
            raise RuntimeError(f"a decode step of {n} gave {len(out.outputs)} outputs")
        decode_steps += 1
        if decode_steps > args.warmup_steps:
            host_s, span_s = forward
            steps.append({"step_s": wall, "host_s": host_s, "span_s": span_s, "ctx": context})
    prefill_s = time.perf_counter() - began
    if not steps:
        return {"seqs": n, "error": "the requests ended before a decode step was timed"}
    # On the CPU (or without the sleep) the forward's figures are one: its time as run.
    kernels = {"kernels_s": statistics.median(s["span_s"] for s in steps)}
    kernels["queued_whole"] = not dev.cuda
    if dev.cuda and hasattr(torch.cuda, "_sleep"):
        runner = core.runner
        assert isinstance(runner, model_runner.ModelRunner)
        model, last = runner.model, timer.last_args
        host_s = statistics.median(s["host_s"] for s in steps)
        with torch.inference_mode():  # as the runner runs it
            kernels = kernel_time(lambda: model.forward(*last), host_s, args.replays)
    return summarise(n, steps, kernels, prefill_steps, prefill_s, core, bandwidths)


def summarise(
    n: int,
    steps: list[dict[str, float]],
    kernels: dict[str, Any],
    prefill_steps: int,
    prefill_s: float,
    core: EngineCore,
    bandwidths: tuple[float, float],
) -> dict[str, Any]:
    """The row's figures: medians of the timed steps; rooflines at the nominal and at the
    copy's bandwidth (bytes a second)."""
    config = core.model_config
    runner = core.runner
    assert isinstance(runner, model_runner.ModelRunner)
    weights = weight_bytes(runner.model)
    kv_read = statistics.mean(s["ctx"] for s in steps) * config.kv_bytes_per_token(
        runner.kv_dtype.itemsize
    )
    step_s = statistics.median(s["step_s"] for s in steps)
    span_s = statistics.median(s["span_s"] for s in steps)
    kernels_s = kernels["kernels_s"]
    roofline_s, roofline_copy_s = ((weights + kv_read) / bw for bw in bandwidths)
    return {
        "seqs": n,
        "context": round(statistics.mean(s["ctx"] for s in steps) / n, 1),
        "timed_steps": len(steps),
        "prefill_steps": prefill_steps,
        "preemptions": core.scheduler.num_preemptions,
        "prefill_and_decode_s": prefill_s,
        "step_s": step_s,
        "forward_host_s": statistics.median(s["host_s"] for s in steps),
        "forward_span_s": span_s,
        "forward_kernels_s": kernels_s,
        "kernels_queued_whole": kernels["queued_whole"],
        "weight_bytes": weights,
        "kv_read_bytes": int(kv_read),
        "roofline_s": roofline_s,
        "roofline_copy_s": roofline_copy_s,
        "step_over_roofline": step_s / roofline_s,
        "kernels_over_roofline": kernels_s / roofline_s,
        "step_over_roofline_copy": step_s / roofline_copy_s,
        "wait_engine_share": (step_s - span_s) / step_s,
        "wait_launch_share": (span_s - kernels_s) / step_s,
        "busy_share": kernels_s / step_s,
        "tokens_per_s": n / step_s,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    torch.manual_seed(0)
    dev = Device(torch.device(args.device))
    shape = TINY if args.tiny else LLAMA3_8B
    config = ModelConfig.from_dict(shape)
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    log(f"{dev.describe()}: measuring a {args.copy_mib} MiB copy")
    copy_bps = copy_bandwidth(dev, args.copy_mib * 2**20)
    nominal_gbs = args.bandwidth_gbs or (H200_BANDWIDTH_GBS if dev.cuda else copy_bps / 1e9)
    log(f"copy: {copy_bps / 1e9:.0f} GB/s (read + write); roofline at {nominal_gbs:.0f} GB/s")
    # Rows whose KV cache and activations fit beside the weights; the cache sized for the
    # largest of them (rows run one after another).
    free = dev.free_bytes()
    all_weights = (config.num_params + config.vocab_size * config.hidden_size) * itemsize
    rows: list[dict[str, Any]] = []
    fits = []
    for n in args.seqs:
        need = all_weights + row_memory(n, args, config, itemsize)
        if free is not None and need > free:
            reason = f"needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
            log(f"{n} sequences: skipped ({reason})")
            rows.append({"seqs": n, "skipped": reason})
        else:
            fits.append(n)
    log(f"building the model ({config.num_params / 1e6:,.1f}M parameters a token reads)")
    core = build_engine(args, shape, fits)
    runner = core.runner
    assert isinstance(runner, model_runner.ModelRunner)
    log(f"model and a {runner.kv_cache_bytes / GIB:.2f} GiB KV cache ready")
    timer = ForwardTimer(runner.model, dev)
    for n in fits:
        if time.monotonic() - t0 > args.time_limit_s:
            rows.append({"seqs": n, "skipped": f"time limit of {args.time_limit_s:g} s reached"})
            continue
        log(f"{n} sequences of {args.context} tokens: prefilling, then decoding")
        try:
            row = decode_row(core, timer, dev, n, args, t0, (nominal_gbs * 1e9, copy_bps))
        except torch.OutOfMemoryError as exc:
            rows.append({"seqs": n, "error": f"out of memory: {str(exc)[:300]}"})
            log(f"{n} sequences: out of memory; no further rows")
            after = fits[fits.index(n) + 1 :]
            rows += [{"seqs": m, "skipped": f"not run after {n} ran out of memory"} for m in after]
            break
        rows.append(row)
        if "step_s" in row:
            log(
                f"{n} sequences: step {row['step_s'] * 1e3:.2f} ms, forward span "
                f"{row['forward_span_s'] * 1e3:.2f} ms, kernels "
                f"{row['forward_kernels_s'] * 1e3:.2f} ms, roofline "
                f"{row['roofline_s'] * 1e3:.2f} ms, engine wait {row['wait_engine_share']:.0%}"
            )
    rows.sort(key=lambda r: r["seqs"])
    print_table(rows)
    return {
        "device": dev.describe(),
        "model": {"shape": "tiny" if args.tiny else "Llama-3-8B", "config": shape},
        "dtype": args.dtype,
        "weight_bytes": weight_bytes(runner.model),
        "kv_bytes_per_token": config.kv_bytes_per_token(itemsize),
        "bandwidth_nominal_gbs": nominal_gbs,
        "bandwidth_copy_gbs": copy_bps / 1e9,
        "total_s": time.monotonic() - t0,
        "rows": rows,
    }


def build_engine(args: argparse.Namespace, shape: dict[str, Any], fits: list[int]) -> EngineCore:
    """The engine on a model folder of `shape`'s config.json alone, its weights random
    (`random_weights`), its KV cache sized for the largest row in `fits`."""
    config = ModelConfig.from_dict(shape)
    kv_token = config.kv_bytes_per_token(
        torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    )
    kv_bytes = max(
        (n * seq_blocks(n, args) * BLOCK * kv_token for n in fits), default=BLOCK * kv_token
    )
    max_len = args.context + max((decode_budget(n, args) for n in fits), default=1)
    engine_config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        num_threads=args.num_threads,
        max_model_len=max_len,
        cache=CacheConfig(block_size=BLOCK, kv_cache_memory=kv_bytes, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=max(args.seqs),
            max_model_len=max_len,
        ),
        scheduling_policy=args.scheduling_policy,
        overlap={"auto": None, "on": True, "off": False}[args.overlap],
    )
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(shape))
        with random_weights():
            return EngineCore(
                replace(engine_config, model=folder),
                step_model_config=StepModelConfig(profile=False),
            )


def print_table(rows: list[dict[str, Any]]) -> None:
    table = [
        ["seqs", "step ms", "span ms", "kernels ms", "roofline ms", "step/roof", "engine wait"]
    ]
    for r in rows:
        if "step_s" not in r:
            table.append([str(r["seqs"]), r.get("skipped") or r.get("error", ""), *[""] * 5])
            continue
        table.append(
            [
                str(r["seqs"]),
                f"{r['step_s'] * 1e3:.2f}",
                f"{r['forward_span_s'] * 1e3:.2f}",
                f"{r['forward_kernels_s'] * 1e3:.2f}",
                f"{r['roofline_s'] * 1e3:.2f}",
                f"{r['step_over_roofline']:.2f}",
                f"{r['wait_engine_share']:.1%}",
            ]
        )
    print(format_table(table))


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    rows = [r for r in result["rows"] if "step_s" in r]
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    if not rows:  # every row skipped or failed: the JSON says why
        fig.text(0.5, 0.5, "no batch size ran", ha="center")
        fig.savefig(path, dpi=110)
        return
    left, right = fig.subplots(1, 2)
    seqs = [r["seqs"] for r in rows]
    for key, label, style in (
        ("step_s", "engine step (wall)", "o-"),
        ("forward_span_s", "forward, span on the device", "s-"),
        ("forward_kernels_s", "forward, kernels alone", "^-"),
        ("roofline_s", f"roofline at {result['bandwidth_nominal_gbs']:.0f} GB/s", "k--"),
    ):
        left.plot(seqs, [r[key] * 1e3 for r in rows], style, label=label)
    copy_gbs = result["bandwidth_copy_gbs"]
    measured = [r["roofline_copy_s"] * 1e3 for r in rows]
    left.plot(seqs, measured, "k:", label=f"roofline at the copy's {copy_gbs:.0f} GB/s")
    left.set(xscale="log", yscale="log", xlabel="sequences decoding", ylabel="ms (median)")
    left.set_title(f"{result['model']['shape']}, {result['dtype']}, {result['device']['type']}")
    left.legend(fontsize="small")
    labels = [str(n) for n in seqs]
    bottom = [0.0] * len(rows)
    for key, label in (
        ("busy_share", "forward's kernels"),
        ("wait_launch_share", "waiting on launches in the forward"),
        ("wait_engine_share", "waiting for the engine"),
    ):
        values = [r[key] * 100 for r in rows]
        right.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set(xlabel="sequences decoding", ylabel="% of the step's wall time")
    right.set_title("where a decode step's time goes")
    right.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    run_and_write(parse_args(argv), "gpu_check", run, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
