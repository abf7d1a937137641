"""Batch fairness across API keys: key B's small job beside key A's 100,000-request job.

A real `tokenfleet serve` with the fixed-token runner (`--runner fixed`: every step answers
a fixed token without running the model) and two API keys (`--api-keys-file`). First key
B's job (10 requests) runs alone on the idle server, --repeats times; then key A creates
its large job and, once it runs, key B submits the same job again, --repeats times. Each
time is from B's create until its batch is `ended`. The pass mark (issue 29): B beside A
within 2x B alone. The store shares batch capacity across the keys that have queued work
(each lease goes to the key holding the fewest leases; deadline order within a key).

    .venv/bin/python bench/batch_fairness.py                       # A: 100,000 requests
    .venv/bin/python bench/batch_fairness.py --a-requests 20000 --out /tmp/fair  # quicker

Prints a table; writes `batch_fairness.json` and `batch_fairness.png` into --out. Exits 1
when the median time beside A is over 2x the median alone.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from common.results import args_json, format_table, machine_info
from common.server import tokenfleet_serve

MODEL = "smollm2-135m-instruct"
RESULT_NAME = "batch_fairness"
KEY_A, KEY_B = "key-a-large-job", "key-b-small-job"
PASS_RATIO = 2.0


def create_body(num: int, max_tokens: int, tag: str) -> Iterator[bytes]:
    """A Message Batches create body of `num` requests, built a line at a time."""
    yield b'{"requests": ['
    for i in range(num):
        item = {
            "custom_id": f"{tag}-{i}",
            "params": {
                "model": MODEL,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Question {i}?"}],
            },
        }
        yield (b"," if i else b"") + json.dumps(item).encode()
    yield b"]}"


def create(http: httpx.Client, key: str, num: int, max_tokens: int, tag: str) -> dict[str, Any]:
    response = http.post(
        "/v1/messages/batches",
        content=create_body(num, max_tokens, tag),
        headers={"x-api-key": key, "content-type": "application/json"},
    )
    if response.status_code != 200:
        raise RuntimeError(f"create failed: {response.status_code} {response.text[:2000]}")
    batch: dict[str, Any] = response.json()
    return batch


def get(http: httpx.Client, key: str, batch_id: str) -> dict[str, Any]:
    batch: dict[str, Any] = http.get(
        f"/v1/messages/batches/{batch_id}", headers={"x-api-key": key}
    ).json()
    return batch


PHASES: list[dict[str, float]] = []  # each of B's jobs: when it was accepted, all done, ended


def time_small_job(http: httpx.Client, args: argparse.Namespace, tag: str) -> float:
    """Seconds from key B's create until its batch is ended (all succeeded)."""
    t0 = time.monotonic()
    batch = create(http, KEY_B, args.b_requests, args.b_max_tokens, tag)
    phases = {"accepted_s": time.monotonic() - t0}
    deadline = t0 + args.timeout
    while batch["processing_status"] != "ended":
        if time.monotonic() > deadline:
            raise TimeoutError(f"key B's job not ended in {args.timeout} s: {batch}")
        time.sleep(0.01)
        batch = get(http, KEY_B, batch["id"])
        if batch["request_counts"]["processing"] == 0 and "results_in_s" not in phases:
            phases["results_in_s"] = time.monotonic() - t0
    took = time.monotonic() - t0
    phases["ended_s"] = took
    PHASES.append(phases)
    if batch["request_counts"]["succeeded"] != args.b_requests:
        raise RuntimeError(f"key B's job: {batch['request_counts']}")
    return took


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=3600) as http:
        time_small_job(http, args, "warm-up")
        alone = [time_small_job(http, args, f"alone-{r}") for r in range(args.repeats)]
        print(f"key B alone: {', '.join(f'{s:.2f}' for s in alone)} s")

        print(f"key A creates {args.a_requests} requests ...")
        t0 = time.monotonic()
        big = create(http, KEY_A, args.a_requests, args.a_max_tokens, "a")
        accept_s = time.monotonic() - t0
        print(f"accepted in {accept_s:.1f} s")
        while get(http, KEY_A, big["id"])["request_counts"]["succeeded"] < args.a_started:
            time.sleep(0.05)
        beside, a_done = [], []
        for r in range(args.repeats):
            beside.append(time_small_job(http, args, f"beside-{r}"))
            counts = get(http, KEY_A, big["id"])["request_counts"]
            a_done.append(counts["succeeded"])
            if counts["processing"] == 0:
                raise RuntimeError("key A's job ended before key B's last: use a larger A")
        print(f"key B beside A: {', '.join(f'{s:.2f}' for s in beside)} s")
        a_rate = None
        if args.finish_a:
            batch = get(http, KEY_A, big["id"])
            while batch["processing_status"] != "ended":
                time.sleep(0.5)
                batch = get(http, KEY_A, big["id"])
            a_rate = args.a_requests / (time.monotonic() - t0 - accept_s)
        else:
            http.post(f"/v1/messages/batches/{big['id']}/cancel", headers={"x-api-key": KEY_A})
    ratio = statistics.median(beside) / statistics.median(alone)
    return {
        "b_alone_s": alone,
        "b_beside_a_s": beside,
        "a_succeeded_when_b_ended": a_done,
        "a_accept_s": accept_s,
        "a_requests_per_s": a_rate,
        "ratio_of_medians": ratio,
        "b_phases": PHASES,  # warm-up, alone..., beside...
        "pass_ratio": PASS_RATIO,
        "passed": ratio <= PASS_RATIO,
    }


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    alone, beside = result["b_alone_s"], result["b_beside_a_s"]
    ax.bar([i - 0.2 for i in range(len(alone))], alone, 0.4, label="key B alone (idle server)")
    ax.bar([i + 0.2 for i in range(len(beside))], beside, 0.4, label="key B beside key A's job")
    ax.axhline(
        PASS_RATIO * statistics.median(alone), color="red", ls="--", label="pass mark: 2x alone"
    )
    ax.set_xlabel("repeat")
    ax.set_ylabel("key B's job: create to ended (s)")
    a = result["args"]["a_requests"]
    ax.set_title(f"{result['args']['b_requests']} requests of key B, beside {a:,} of key A")
    ax.legend()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--a-requests", type=int, default=100_000, help="key A's job: requests")
    add("--a-max-tokens", type=int, default=4, help="key A's requests: output tokens")
    add("--a-started", type=int, default=500, help="A's results before B is submitted")
    add("--b-requests", type=int, default=10, help="key B's job: requests")
    add("--b-max-tokens", type=int, default=64, help="key B's requests: output tokens")
    add("--repeats", type=int, default=5, help="key B's job this many times, each way")
    add("--max-num-seqs", type=int, default=64, help="engine sequence slots (serve's default)")
    add("--finish-a", action="store_true", help="let A's job finish (else cancel it)")
    add("--timeout", type=float, default=600, help="seconds any one of B's jobs may take")
    add("--database-url", default=None, help="postgresql://... (default: SQLite)")
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    started = datetime.now(UTC)
    with tempfile.TemporaryDirectory(prefix="tokenfleet-batch-fairness-") as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"{KEY_A}\n{KEY_B}\n")
        flags = ["--runner", "fixed", "--max-num-seqs", str(args.max_num_seqs)]
        flags += ["--api-keys-file", str(keys)]
        flags += ["--max-batch-requests", str(max(100_000, args.a_requests))]
        if args.database_url:
            flags += ["--database-url", args.database_url]
        with tokenfleet_serve("serve", Path(tmp), flags) as server:
            result = run(args, server.url)

    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": started.isoformat(timespec="seconds"),
        "machine": machine_info(1),
        "args": args_json(args),
        **result,
    }
    rows = [
        ["key B's job", "median s", "each s"],
        [
            "alone (idle server)",
            f"{statistics.median(result['b_alone_s']):.2f}",
            " ".join(f"{s:.2f}" for s in result["b_alone_s"]),
        ],
        [
            f"beside A's {args.a_requests:,}",
            f"{statistics.median(result['b_beside_a_s']):.2f}",
            " ".join(f"{s:.2f}" for s in result["b_beside_a_s"]),
        ],
    ]
    print(format_table(rows))
    verdict = "pass" if result["passed"] else "FAIL"
    print(f"beside / alone: {result['ratio_of_medians']:.2f}x ({verdict}: at most {PASS_RATIO}x)")
    print(f"key A's create accepted in {result['a_accept_s']:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{RESULT_NAME}.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png_path = args.out / f"{RESULT_NAME}.png"
    plot(png_path, result)
    print(f"wrote {json_path} and {png_path}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
