"""A prompt that fills the model's whole context, arriving among running interactive
streams: how far does it stretch their largest inter-token gap, against the TPOT target?

    fresh tokenfleet server (--max-model-len 8192, the calibrated --tpot-target)
      t=0       --streams greedy streams (short prompts, long outputs) start
      t=warm-up one prompt of the whole context (8,192 tokens with the chat template,
                max_tokens 1) arrives
      until its first token (+ 2 s): every stream token's arrival time

Per configuration: the streams' largest gap before the long prompt, the largest gap while
it was prefilled (sent to first token), their gap p50/p99 over that window, and the long
prompt's TTFT. Configurations: `priority` (tokenfleet's default: prompt chunks cut so the
predicted step stays within the TPOT target less the margin, at least --min-prefill-chunk
tokens), `fcfs` (priorities off: whole 512-token chunks, as vLLM's default scheduler
does), and `priority` at other floors (--floors), KV dtypes (--kv-dtypes) and harvest
margins (--margins).

    .venv/bin/python bench/long_prompt.py            # about 10 minutes
    .venv/bin/python bench/long_prompt.py --configs fcfs --max-model-len 2048   # quick

The TPOT target comes from bench/mixed_load.py's calibration JSON (--calibration), or
--tpot-target. Writes long_prompt.json and long_prompt.png into --out (bench/results).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common.calibration import GreedyEndpoint
from common.log import log
from common.results import RunStart, args_json, fmt_ms, format_table, write_result
from common.server import tokenfleet_server

from tokenfleet.checkpoint.folder import resolve_model_folder
from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.loadgen.client import RequestRecord, stream_request
from tokenfleet.loadgen.report import percentile
from tokenfleet.loadgen.workload import WORDS, RequestSpec

RESULT_NAME = "long_prompt"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--calibration", type=Path, default=Path("bench/results/mixed_load.json"))
    add("--tpot-target", type=float, help="seconds (default: the calibration's)")
    add("--configs", default="priority,fcfs", help="priority, fcfs, or both")
    add("--floors", default="", help="more priority runs at these --min-prefill-chunk values")
    add("--kv-dtypes", default="", help="more priority runs at these --kv-cache-dtype values")
    add(
        "--margins",
        default="",
        help="more priority runs at these --harvest-margin values (with the model's KV dtype "
        "and each of --kv-dtypes)",
    )
    add("--streams", type=int, default=3)
    add(
        "--stream-tokens",
        type=int,
        default=0,
        help="each stream's output tokens, a new stream taking its place when it ends "
        "(0, the default: streams long enough to outlast the long prompt)",
    )
    add("--warm-up", type=float, default=5.0, help="seconds of streams before the long prompt")
    add("--max-model-len", type=int, default=8192)
    add("--num-threads", type=int, default=1)
    add("--timeout", type=float, default=900.0, help="seconds for the long prompt's first token")
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    runs: list[tuple[str, str, list[str]]] = []  # (name, policy, extra serve arguments)
    for config in filter(None, args.configs.split(",")):
        if config not in ("priority", "fcfs"):
            parser.error(f"unknown configuration {config!r}")
        runs.append((config, config, []))
    for floor in filter(None, args.floors.split(",")):
        runs.append((f"priority, floor {floor}", "priority", ["--min-prefill-chunk", floor]))
    dtypes = list(filter(None, args.kv_dtypes.split(",")))
    for dtype in dtypes:
        runs.append((f"priority, {dtype} KV", "priority", ["--kv-cache-dtype", dtype]))
    for margin in filter(None, args.margins.split(",")):
        for dtype in ["", *dtypes]:
            name = (
                f"priority, {dtype} KV, margin {margin}" if dtype else f"priority, margin {margin}"
            )
            extra = ["--kv-cache-dtype", dtype] if dtype else []
            runs.append((name, "priority", [*extra, "--harvest-margin", margin]))
    args.runs = runs
    return args


def tpot_target(args: argparse.Namespace) -> float:
    if args.tpot_target:
        return float(args.tpot_target)
    data = json.loads(args.calibration.read_text())
    log(f"TPOT target from {args.calibration} ({data['date']})")
    return float(data["calibration"]["tpot_target_s"])


def whole_context_prompt(max_model_len: int, max_tokens: int) -> tuple[str, int]:
    """Words whose chat-templated prompt is max_model_len - max_tokens tokens, or just
    under: (text, prompt tokens)."""
    tokenizer = Tokenizer(resolve_model_folder(None))
    rng = random.Random(0)
    words = [rng.choice(WORDS) for _ in range(max_model_len)]

    def count(n: int) -> int:
        text = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words[:n])}])
        return len(tokenizer.encode(text))

    budget = max_model_len - max_tokens
    low, high = 1, max_model_len
    while low < high:  # the most words within the budget
        mid = (low + high + 1) // 2
        if count(mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low]), count(low)


class EveryTokenEndpoint(GreedyEndpoint):
    """Greedy, with logprobs: the server then sends a chunk for every token, also one that
    shows no text, so each token's arrival is timed. (Counting text chunks only, a stream
    whose output reached its end-of-turn tokens, EOS ignored, showed a gap of two or three
    steps at each: most of the large gaps the first runs reported.)"""

    def body(self, spec: RequestSpec, prompt: str, *, stream: bool) -> dict[str, Any]:
        return super().body(spec, prompt, stream=stream) | {"logprobs": True}


async def measure(
    url: str, args: argparse.Namespace, prompt: str, prompt_tokens: int
) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=args.timeout + 60) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        endpoint = EveryTokenEndpoint(url, "openai", model, None, True)
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        # Outputs to outlast the long prompt's prefill, within the context; or streams of
        # --stream-tokens, each replaced by a new one when it ends.
        num_out = args.stream_tokens or args.max_model_len - 100
        streams: list[RequestRecord] = []

        async def slot(i: int) -> None:
            for n in itertools.count():
                spec = RequestSpec(f"s{i}-{n}", "interactive", 0, 16, num_out)
                record = RequestRecord.of(spec)
                streams.append(record)
                prompt = f"Count slowly, stream {spec.req_id}:"
                await stream_request(
                    http, endpoint, spec, prompt, record, clock, timeout_s=args.timeout + 60
                )
                if not args.stream_tokens:
                    return

        tasks = [asyncio.create_task(slot(i)) for i in range(args.streams)]
        await asyncio.sleep(args.warm_up)
        long_spec = RequestSpec("long", "interactive", 0, prompt_tokens, 1)
        long = RequestRecord.of(long_spec)
        await stream_request(http, endpoint, long_spec, prompt, long, clock, timeout_s=args.timeout)
        await asyncio.sleep(2.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if long.status != "ok" or long.sent_s is None or not long.token_times_s:
        raise RuntimeError(f"the long prompt failed: {long.status} {long.error}")
    for record in streams:
        if record.status in ("refused", "errored"):
            raise RuntimeError(f"stream {record.req_id} failed: {record.status} {record.error}")
    sent, first = long.sent_s, long.token_times_s[0]
    before: list[float] = []
    during: list[float] = []
    for record in streams:
        times = record.token_times_s
        for a, b in itertools.pairwise(times):
            if b <= sent:
                before.append(b - a)
            elif a < first:  # a gap that overlaps the prefill
                during.append(b - a)
    return {
        "prompt_tokens": prompt_tokens,
        "long_ttft_s": first - sent,
        "gap_before_max_s": max(before, default=None),
        "gap_before_p50_s": percentile(before, 50),
        "gap_during_max_s": max(during, default=None),
        "gap_during_p50_s": percentile(during, 50),
        "gap_during_p99_s": percentile(during, 99),
        "num_gaps_during": len(during),
        "gaps_during_s": during,
        "num_streams": len(streams),
        "stream_token_times_s": [r.token_times_s for r in streams],
        "long_sent_s": sent,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = RunStart.now()
    target = tpot_target(args)
    prompt, prompt_tokens = whole_context_prompt(args.max_model_len, 1)
    log(f"TPOT target {target * 1000:.1f} ms; the long prompt: {prompt_tokens} tokens")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tokenfleet-long-") as tmp_name:
        tmp = Path(tmp_name)
        for name, policy, extra in args.runs:
            with tokenfleet_server(
                args,
                tmp,
                name.replace(" ", "").replace(",", "-"),
                policy,
                (3600.0, target),
                extra,
            ) as server:
                row = asyncio.run(measure(server.url, args, prompt, prompt_tokens))
            row["within_target"] = (row["gap_during_max_s"] or 0) <= target
            rows[name] = row
            log(
                f"{name}: long TTFT {row['long_ttft_s']:.1f} s; stream gaps before: max "
                f"{fmt_ms(row['gap_before_max_s'])} ms; during its prefill: p50 "
                f"{fmt_ms(row['gap_during_p50_s'])}, max {fmt_ms(row['gap_during_max_s'])} ms "
                f"(target {target * 1000:.0f} ms)"
            )
    lines = [
        [
            "configuration",
            "long TTFT s",
            "gap before max ms",
            "gap during p50/p99/max ms",
            "max / target",
        ]
    ]
    for name, row in rows.items():
        lines.append(
            [
                name,
                f"{row['long_ttft_s']:.1f}",
                fmt_ms(row["gap_before_max_s"]),
                "/".join(fmt_ms(row[f"gap_during_{q}_s"]) for q in ("p50", "p99", "max")),
                f"{(row['gap_during_max_s'] or 0) / target:.2f}",
            ]
        )
    print(format_table(lines))
    out = start.provenance(args) | {
        "args": args_json(args),
        "tpot_target_s": target,
        "results": rows,
    }
    write_result(args.out, RESULT_NAME, out, lambda path: plot(path, rows, target))
    return 0


def plot(path: Path, rows: dict[str, dict[str, Any]], target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 3 * len(rows)), squeeze=False)
    for ax, (name, row) in zip(axes[:, 0], rows.items(), strict=True):
        for times in row["stream_token_times_s"]:
            gaps = [b - a for a, b in itertools.pairwise(times)]
            ax.plot(times[1:], [g * 1000 for g in gaps], marker=".", linewidth=0.5)
        sent = row["long_sent_s"]
        ax.axvspan(
            sent,
            sent + row["long_ttft_s"],
            color="orange",
            alpha=0.2,
            label="long prompt: sent to first token",
        )
        ax.axhline(target * 1000, color="grey", linestyle="--", label="TPOT target")
        ax.set(title=name, xlabel="s since start", ylabel="inter-token gap (ms)", yscale="log")
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
