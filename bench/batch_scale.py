"""Batch API at scale: a 100,000-request Message Batch through a real `tokenfleet serve`.

The engine runs the fixed-token runner (`--runner fixed`: every step answers a fixed token
without running the model), so what is measured is everything else at full scale: the
gateway's streamed parsing and checking of the create body (each request's params checked
as the sync API checks them: chat template, tokenizer, length), the store (SQLite in a
fresh data folder, or --database-url), the dispatcher's leasing and group commits, the
engine process's scheduler and KV manager, and the results download.

    .venv/bin/python bench/batch_scale.py                        # 100,000 requests
    .venv/bin/python bench/batch_scale.py --requests 5000 --out /tmp/bench   # quick check
    # a 256 MB body: 10,000 requests of ~5,000 prompt tokens
    .venv/bin/python bench/batch_scale.py --requests 10000 --pad-words 5100 --max-tokens 1 \
        --max-num-batched-tokens 8192 --out bench/results/batch_scale_256mb

Reports the accept time (POST until the batch object came back), the end-to-end time
(create until `ended`), results lines and distinct custom_ids, and the gateway's and
engine's peak resident memory (VmHWM) against their memory before the batch. Writes
`batch_scale.json` and `batch_scale.png` (requests done over time) into --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from common.results import args_json, format_table, machine_info
from common.server import Server, tokenfleet_serve
from tqdm import tqdm

MODEL = "smollm2-135m-instruct"
RESULT_NAME = "batch_scale"


def memory_kib(pid: int) -> dict[str, int]:
    """Resident memory now and at its peak (VmRSS, VmHWM), KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def request_lines(num: int, max_tokens: int, pad: int) -> Iterator[bytes]:
    """The create body, built line by line: {"requests": [...]} of `num` requests."""
    yield b'{"requests": ['
    filler = " ".join(["word"] * pad)
    for i in range(num):
        content = f"Question {i}: what comes after {i}? {filler}".rstrip()
        item = {
            "custom_id": f"req-{i}",
            "params": {
                "model": MODEL,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": content}],
            },
        }
        yield (b"," if i else b"") + json.dumps(item).encode()
    yield b"]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--requests", type=int, default=100_000, help="requests in the batch")
    add("--max-tokens", type=int, default=4, help="output tokens per request")
    add("--pad-words", type=int, default=0, help="extra words per prompt (a larger body)")
    add("--max-num-seqs", type=int, default=256, help="engine sequence slots (= batch depth)")
    add("--max-num-batched-tokens", type=int, default=512, help="engine token budget per step")
    add("--database-url", default=None, help="postgresql://... (default: SQLite)")
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    started = datetime.now(UTC)
    with tempfile.TemporaryDirectory(prefix="tokenfleet-batch-scale-") as tmp:
        flags = ["--runner", "fixed", "--max-num-seqs", str(args.max_num_seqs)]
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.database_url:
            flags += ["--database-url", args.database_url]
        with tokenfleet_serve("serve", Path(tmp), flags) as server:
            result = run(args, server)

    result.update(
        {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": started.isoformat(timespec="seconds"),
            "machine": machine_info(1),
            "args": args_json(args),
        }
    )
    rows = [
        ["requests", "body MB", "accept s", "end-to-end s", "req/s", "result lines"],
        [
            str(args.requests),
            f"{result['body_bytes'] / 1e6:.1f}",
            f"{result['accept_s']:.1f}",
            f"{result['end_to_end_s']:.1f}",
            f"{args.requests / result['end_to_end_s']:.0f}",
            f"{result['result_lines']} ({result['distinct_custom_ids']} distinct)",
        ],
    ]
    print(format_table(rows))
    mem = result["memory_kib"]
    for role in ("gateway", "engine"):
        print(
            f"{role}: resident {mem[role]['before']['VmRSS'] / 1024:.0f} MiB before the batch, "
            f"peak {mem[role]['after']['VmHWM'] / 1024:.0f} MiB"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{RESULT_NAME}.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png_path = args.out / f"{RESULT_NAME}.png"
    plot(png_path, result)
    print(f"wrote {json_path} and {png_path}")
    ok = result["result_lines"] == result["distinct_custom_ids"] == args.requests
    return 0 if ok else 1


def run(args: argparse.Namespace, server: Server) -> dict:
    url = server.url
    engine_pid = int(server.ready["engine_pid"])
    before = {"gateway": memory_kib(server.process.pid), "engine": memory_kib(engine_pid)}
    body_bytes = sum(len(c) for c in request_lines(args.requests, args.max_tokens, args.pad_words))

    print(f"creating a batch of {args.requests} requests ({body_bytes / 1e6:.1f} MB body) ...")
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=3600) as http:
        response = http.post(
            "/v1/messages/batches",
            content=request_lines(args.requests, args.max_tokens, args.pad_words),
            headers={"content-type": "application/json"},
        )
        accept_s = time.monotonic() - t0
        if response.status_code != 200:
            raise RuntimeError(f"create failed: {response.status_code} {response.text[:2000]}")
        batch_id = response.json()["id"]
        timeline = [(accept_s, 0)]
        with tqdm(total=args.requests, desc="requests", unit="req") as bar:
            while True:
                batch = http.get(f"/v1/messages/batches/{batch_id}").json()
                counts = batch["request_counts"]
                done = sum(v for k, v in counts.items() if k != "processing")
                bar.update(done - bar.n)
                timeline.append((time.monotonic() - t0, done))
                if batch["processing_status"] == "ended":
                    break
                time.sleep(0.5)
        end_to_end_s = time.monotonic() - t0
        after = {"gateway": memory_kib(server.process.pid), "engine": memory_kib(engine_pid)}
        t1 = time.monotonic()
        lines, ids, types = 0, set(), {}
        with http.stream("GET", f"/v1/messages/batches/{batch_id}/results") as results:
            for line in results.iter_lines():
                if not line:
                    continue
                item = json.loads(line)
                lines += 1
                ids.add(item["custom_id"])
                kind = item["result"]["type"]
                types[kind] = types.get(kind, 0) + 1
        download_s = time.monotonic() - t1
    return {
        "batch_id": batch_id,
        "body_bytes": body_bytes,
        "accept_s": accept_s,
        "end_to_end_s": end_to_end_s,
        "results_download_s": download_s,
        "request_counts": counts,
        "result_lines": lines,
        "distinct_custom_ids": len(ids),
        "result_types": types,
        "memory_kib": {
            role: {"before": before[role], "after": after[role]} for role in ("gateway", "engine")
        },
        "timeline": timeline,
    }


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    ts, done = zip(*result["timeline"], strict=True)
    ax.plot(ts, done, color="tab:blue", label="requests with a result")
    ax.axvline(result["accept_s"], color="tab:orange", linestyle="--", label="batch accepted")
    ax.set_xlabel("seconds since the create call")
    ax.set_ylabel("requests")
    ax.set_title(
        f"{result['args']['requests']:,} requests: accepted in {result['accept_s']:.1f} s, "
        f"ended in {result['end_to_end_s']:.1f} s"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
