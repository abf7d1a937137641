"""Canary streams during a hostile burst against idle: TPOT p50 and p99 of a few greedy
streams while every hostile class of docs/reliability.md is sent beside them.

    one `tokenfleet serve` (the bundled model, API keys, --requests-per-minute-per-group 20,
    2 s header and body deadlines, a 1 s stream-stall deadline)
      idle   --canaries greedy streams at once (/v1/chat/completions, --max-tokens each),
             --repeats times, nothing else
      burst  the same, --repeats times back to back; from the moment the first ones stream
             until the last one ends, each hostile class runs round after round in a thread
             of its own: fields out of range, amplification (prompts x n), a 3 MB body,
             60 half-sent connections, an unread 16-choice stream, non-ASCII key bytes,
             a 40-request flood from one group, batches with a poison line

TPOT here is each canary token's time since the token before it (the first token left
out). Reports TPOT p50 and p99 idle and during the burst, their ratio (goal: p99 within
1.5x of idle), whether every canary's tokens equal its idle tokens, and each hostile
class's rounds and outcomes (any other outcome, a 5xx above all, is counted apart).

    .venv/bin/python bench/hostile_burst.py                  # a few minutes on 2 cores
    .venv/bin/python bench/hostile_burst.py --repeats 1 --max-tokens 32 --out /tmp/hb

Writes hostile_burst.json and hostile_burst.png into --out. Exits 1 if a canary's tokens
differ from idle or a hostile request got an outcome other than its expected one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common.log import log
from common.results import RunStart, args_json, fmt_ms, format_table, write_result
from common.server import tokenfleet_serve
from common.stats import percentile

MODEL = "smollm2-135m-instruct"
RESULT_NAME = "hostile_burst"
GOAL_RATIO = 1.5
OPERATOR_KEY = "operator-key-1"
REQUESTS_PER_MINUTE = 20  # each key group's; the flood's group meets it, the others not
POOL = 30  # keys (groups) the out-of-range and amplification classes rotate through
PROMPTS = [
    "Tell me a long story about a dragon.",
    "Write a long poem about the sea.",
    "Describe a journey across a desert in detail.",
    "Explain how a city works, street by street.",
]
TIMEOUT_S = 120.0


# -- the canaries -------------------------------------------------------------------------


@dataclass
class Canary:
    prompt: int
    tokens: list[str] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # each token's time since the one before


async def canary(
    http: httpx.AsyncClient, key: str, prompt: int, max_tokens: int, streaming: asyncio.Event
) -> Canary:
    """One greedy stream; its tokens (from logprobs) and the gap before each after the first.
    `streaming` is set at its first token."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[prompt % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 0,
        "stream": True,
    }
    found = Canary(prompt)
    last = None
    headers = {"x-api-key": key}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"canary refused: {reply.status_code} {await reply.aread()!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens = [e["token"] for e in (choice.get("logprobs") or {}).get("content") or []]
            if not tokens:
                continue
            now = time.monotonic()
            if last is not None:  # a chunk of k tokens: k gaps of a k-th of its wait each
                found.gaps += [(now - last) / len(tokens)] * len(tokens)
            last = now
            streaming.set()
            found.tokens += tokens
    return found


async def canaries(
    url: str, args: argparse.Namespace, tag: str, begin: Callable[[], None] | None = None
) -> list[Canary]:
    """--canaries streams at once, each with a key (and so a group) of its own; `begin()`
    once every one of them has its first token."""
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
        events = [asyncio.Event() for _ in range(args.canaries)]
        tasks = [
            asyncio.create_task(canary(http, f"canary-{tag}-{i}", i, args.max_tokens, event))
            for i, event in enumerate(events)
        ]
        if begin is not None:
            streaming = asyncio.gather(*(event.wait() for event in events))
            # Whichever comes first: all streaming, or a canary that ended (raised) before.
            await asyncio.wait([streaming, *tasks], return_when=asyncio.FIRST_COMPLETED)
            if streaming.done():
                begin()
            streaming.cancel()
        return list(await asyncio.gather(*tasks))


# -- the hostile classes: one round each; the outcomes it got ---------------------------------


def _post(url: str, path: str, key: str, body: Any) -> httpx.Response:
    headers = {"x-api-key": key, "content-type": "application/json"}
    return httpx.post(url + path, content=json.dumps(body), headers=headers, timeout=TIMEOUT_S)


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        **fields,
    }


OUT_OF_RANGE = [
    ("/v1/chat/completions", _chat(top_k=2**64)),
    ("/v1/chat/completions", _chat(temperature=2.5)),
    ("/v1/chat/completions", _chat(seed=2**64)),
    ("/v1/chat/completions", _chat(seed=2**63 - 1024, n=2)),
    ("/v1/chat/completions", _chat(logit_bias={"1000000": 1})),
    ("/v1/chat/completions", _chat(stop_token_ids=[2**70])),
    ("/v1/chat/completions", _chat(max_tokens=10**6)),
    ("/v1/completions", {"model": MODEL, "prompt": [1_000_000], "max_tokens": 1}),
    ("/v1/messages", _chat(top_k=-1)),
    ("/v1/messages", _chat(temperature=1.5)),
]
AMPLIFICATION = [
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 20, "max_tokens": 1, "n": 4}),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2]] * 64, "max_tokens": 1, "n": 16}),
    ("/v1/chat/completions", _chat(n=17)),
]


class Rounds:
    """Round-robin keys of one class."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.next = prefix, 0

    def key(self) -> str:
        self.next += 1
        return f"{self.prefix}-{self.next % POOL}"


BOUNDS_KEYS, AMPLIFY_KEYS = Rounds("bounds"), Rounds("amplify")


def out_of_range(url: str, stop: threading.Event) -> list[str]:
    return [str(_post(url, p, BOUNDS_KEYS.key(), b).status_code) for p, b in OUT_OF_RANGE]


def amplification(url: str, stop: threading.Event) -> list[str]:
    return [str(_post(url, p, AMPLIFY_KEYS.key(), b).status_code) for p, b in AMPLIFICATION]


HUGE = "The quick brown fox jumps over the lazy dog, said Émile. " * 50_000


def large_body(url: str, stop: threading.Event) -> list[str]:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": HUGE}]}
    return [str(_post(url, "/v1/messages", "big-1", body).status_code)]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def half_sent(url: str, stop: threading.Event) -> list[str]:
    """60 connections: headers that never end, a body that stops, nothing; each should be
    closed by the server (EOF with nothing sent)."""
    held = []
    for i in range(60):
        s = socket.create_connection(("127.0.0.1", _port(url)), timeout=TIMEOUT_S)
        head = b"POST /v1/messages HTTP/1.1\r\nhost: t\r\nx-api-key: big-1\r\n"
        if i % 3 == 0:
            s.sendall(head)
        elif i % 3 == 1:
            s.sendall(head + b"content-length: 100\r\n\r\n" + b'{"model": ')
        held.append(s)
    outcomes = []
    for s in held:
        try:
            outcomes.append("closed" if s.recv(1024) == b"" else "answered")
        except TimeoutError:
            outcomes.append("held")
        finally:
            s.close()
    return outcomes


def _stalled(url: str) -> float:
    text = httpx.get(url + "/metrics", headers={"x-api-key": OPERATOR_KEY}, timeout=TIMEOUT_S).text
    line = next(
        ln for ln in text.splitlines() if ln.startswith("tokenfleet_streams_stalled_total ")
    )
    return float(line.split()[1])


def slow_reader(url: str, stop: threading.Event) -> list[str]:
    """A 16-choice stream with 20 top logprobs a token, never read past its status line:
    aborted (server EOF, no [DONE]) once its send buffer stays full. The client's MSS is
    Ethernet's (loopback's 64 KiB MSS lets the kernel grow the buffer to 4 MiB)."""
    story = [{"role": "user", "content": PROMPTS[0]}]
    body = _chat(max_tokens=2000, n=16, stream=True, logprobs=True, top_logprobs=20)
    data = json.dumps(body | {"messages": story}).encode()
    before = _stalled(url)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1460)
    s.settimeout(TIMEOUT_S)
    try:
        s.connect(("127.0.0.1", _port(url)))
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nx-api-key: slow-1\r\n"
        head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data)
        s.sendall(head + data)
        if s.recv(12) != b"HTTP/1.1 200":
            return ["refused"]
        while _stalled(url) == before:
            if stop.is_set():
                return []  # the burst ended first: not counted
            time.sleep(0.2)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return ["aborted" if b"data: [DONE]" not in got else "finished"]
    finally:
        s.close()


def bad_auth(url: str, stop: threading.Event) -> list[str]:
    outcomes = []
    body = json.dumps(_chat()).encode()
    headers = [b"x-api-key: \xc3\xa9t\xc3\xa9", b"x-api-key: \xff\xfe\x80"]
    headers += [b"authorization: Bearer \xe9\xff", b"x-api-key: canary\xe9"]
    for header in headers:
        for path in (b"/v1/messages", b"/v1/chat/completions"):
            request = b"POST " + path + b" HTTP/1.1\r\nhost: t\r\nconnection: close\r\n"
            request += header + b"\r\ncontent-type: application/json\r\n"
            request += b"content-length: %d\r\n\r\n" % len(body) + body
            with socket.create_connection(("127.0.0.1", _port(url)), timeout=TIMEOUT_S) as s:
                s.sendall(request)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            outcomes.append(reply.split(b" ", 2)[1].decode() if reply else "closed")
    return outcomes


def flood(url: str, stop: threading.Event) -> list[str]:
    """40 requests at once from one group: its requests per minute served, the rest 429."""

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            replies = await asyncio.gather(
                *(
                    http.post(
                        "/v1/messages" if i % 2 else "/v1/chat/completions",
                        json=_chat(),
                        headers={"x-api-key": "flood-1"},
                    )
                    for i in range(40)
                )
            )
        return [str(r.status_code) for r in replies]

    return asyncio.run(run())


def poison_batches(url: str, stop: threading.Event) -> list[str]:
    """An OpenAI batch whose second line is not JSON (created as failed), and a Message
    Batch with a request out of range (400)."""
    good = {"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": _chat()}
    data = json.dumps(good).encode() + b'\n{"custom_id": "poison", "method"\n'
    upload = httpx.post(
        url + "/v1/files",
        files={"file": ("in.jsonl", data)},
        data={"purpose": "batch"},
        headers={"x-api-key": "batch-1"},
        timeout=TIMEOUT_S,
    )
    if upload.status_code != 200:
        return [f"upload {upload.status_code}"]
    create = {
        "input_file_id": upload.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    batch = _post(url, "/v1/batches", "batch-1", create)
    status = batch.json().get("status") if batch.status_code == 200 else batch.status_code
    requests = [
        {"custom_id": "ok", "params": _chat()},
        {"custom_id": "x", "params": _chat(top_k=-1)},
    ]
    refused = _post(url, "/v1/messages/batches", "batch-1", {"requests": requests})
    return [f"batch {status}", str(refused.status_code)]


# The outcome each class should get, every time.
HOSTILE: dict[str, tuple[Callable[[str, threading.Event], list[str]], set[str]]] = {
    "out_of_range": (out_of_range, {"400"}),
    "amplification": (amplification, {"400"}),
    "large_body": (large_body, {"400"}),
    "half_sent": (half_sent, {"closed"}),
    "slow_reader": (slow_reader, {"aborted"}),
    "bad_auth": (bad_auth, {"401"}),
    "flood": (flood, {"200", "429"}),
    "poison_batches": (poison_batches, {"batch failed", "400"}),
}


@dataclass
class Hostile:
    rounds: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)


def hostile_loop(name: str, url: str, pause_s: float, stop: threading.Event, into: Hostile) -> None:
    send, _ = HOSTILE[name]
    while not stop.is_set():
        try:
            got = send(url, stop)
        except Exception as exc:  # counted as an outcome of its own, never expected
            got = [f"error {type(exc).__name__}"]
        into.rounds += bool(got)
        into.outcomes.update(got)
        stop.wait(pause_s)


# -- the runs -----------------------------------------------------------------------------


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    idle: list[Canary] = []
    for r in range(args.repeats):
        found = asyncio.run(canaries(url, args, f"idle-{r}"))
        idle += found
        log(f"idle {r + 1}/{args.repeats}: TPOT p99 {fmt_ms(percentile(_gaps(found), 99))} ms")
    hostile = {name: Hostile() for name in args.classes}
    stop = threading.Event()
    threads = [
        threading.Thread(target=hostile_loop, args=(name, url, args.pause, stop, hostile[name]))
        for name in args.classes
    ]
    burst: list[Canary] = []
    try:

        def begin() -> None:  # once the first burst canaries stream, until the last ends
            if threads[0].ident is None:  # not started yet
                for thread in threads:
                    thread.start()

        for r in range(args.repeats):
            found = asyncio.run(canaries(url, args, f"burst-{r}", begin))
            burst += found
            sent = sum(sum(h.outcomes.values()) for h in hostile.values())
            log(
                f"burst {r + 1}/{args.repeats}: TPOT p99 {fmt_ms(percentile(_gaps(found), 99))}"
                f" ms; {sent} hostile outcomes so far"
            )
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=TIMEOUT_S)
    reference = {c.prompt: c.tokens for c in idle[: args.canaries]}
    exact = all(c.tokens == reference[c.prompt] for c in idle + burst)
    figures = {
        phase: {
            "tpot_p50_s": percentile(_gaps(found), 50),
            "tpot_p99_s": percentile(_gaps(found), 99),
            "tokens": sum(len(c.tokens) for c in found),
        }
        for phase, found in (("idle", idle), ("burst", burst))
    }
    classes = {}
    for name in args.classes:
        expected = HOSTILE[name][1]
        outcomes = hostile[name].outcomes
        classes[name] = {
            "rounds": hostile[name].rounds,
            "outcomes": dict(outcomes),
            "unexpected": sum(n for o, n in outcomes.items() if o not in expected),
            "5xx": sum(n for o, n in outcomes.items() if re.search(r"\b5\d\d\b", o)),
        }
    return {
        "figures": figures,
        "ratio_p50": figures["burst"]["tpot_p50_s"] / figures["idle"]["tpot_p50_s"],
        "ratio_p99": figures["burst"]["tpot_p99_s"] / figures["idle"]["tpot_p99_s"],
        "goal_ratio": GOAL_RATIO,
        "canaries_exact": exact,
        "hostile": classes,
        "gaps_s": {"idle": _gaps(idle), "burst": _gaps(burst)},
    }


def _gaps(found: list[Canary]) -> list[float]:
    return [g for c in found for g in c.gaps]


def keys_file(path: Path, args: argparse.Namespace) -> Path:
    """Every canary its own key and group; the hostile classes' keys (a key alone is its own
    group)."""
    keys = [
        f"canary-{phase}-{r}-{i}"
        for phase in ("idle", "burst")
        for r in range(args.repeats)
        for i in range(args.canaries)
    ]
    keys += [f"{prefix}-{i}" for prefix in ("bounds", "amplify") for i in range(POOL)]
    keys += ["big-1", "slow-1", "flood-1", "batch-1"]
    path.write_text("\n".join(keys) + "\n")
    return path


def plot(path: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for phase, color in (("idle", "tab:blue"), ("burst", "tab:red")):
        gaps = sorted(g * 1000 for g in result["gaps_s"][phase])
        ax.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], color=color, label=phase)
        p99 = result["figures"][phase]["tpot_p99_s"] * 1000
        ax.axvline(p99, color=color, ls=":", label=f"{phase} p99 {p99:.0f} ms")
    goal = result["figures"]["idle"]["tpot_p99_s"] * 1000 * GOAL_RATIO
    ax.axvline(goal, color="black", ls="--", label=f"goal: idle p99 x {GOAL_RATIO}")
    ax.set_xscale("log")
    ax.set_xlabel("canary TPOT: a token's time since the one before (ms)")
    ax.set_ylabel("share of tokens")
    ax.set_title(
        f"canary TPOT p99 {result['ratio_p99']:.2f}x idle during the hostile burst "
        f"(p50 {result['ratio_p50']:.2f}x)"
    )
    ax.legend(loc="lower right")
    fig.savefig(path, dpi=120)


def _classes(text: str) -> list[str]:
    names = text.split(",")
    unknown = set(names) - set(HOSTILE)
    if unknown:
        raise argparse.ArgumentTypeError(f"no such class: {sorted(unknown)}; {list(HOSTILE)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--canaries", type=int, default=2, help="greedy streams at once")
    add("--max-tokens", type=int, default=128, help="tokens per canary stream")
    add("--repeats", type=int, default=2, help="canary runs idle, then during the burst")
    add("--classes", type=_classes, default=list(HOSTILE), help="hostile classes, a,b,...")
    add("--pause", type=float, default=0.2, help="seconds between a hostile class's rounds")
    add("--num-threads", type=int, default=1, help="the engine's torch threads")
    add("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    start = RunStart.now()
    with tempfile.TemporaryDirectory(prefix="tokenfleet-hostile-burst-") as tmp_name:
        tmp = Path(tmp_name)
        flags = ["--api-keys-file", str(keys_file(tmp / "keys.txt", args))]
        flags += ["--operator-key", OPERATOR_KEY, "--num-threads", str(args.num_threads)]
        flags += ["--requests-per-minute-per-group", str(REQUESTS_PER_MINUTE)]
        flags += ["--header-timeout", "2", "--body-timeout", "2", "--stream-stall-timeout", "1"]
        flags += ["--ttft-target", "3600", "--kv-cache-memory", str(512 << 20)]
        with tokenfleet_serve("serve", tmp, flags) as server:
            result = run(args, server.url)

    rows = [["canary TPOT", "p50 ms", "p99 ms", "tokens"]]
    for phase in ("idle", "burst"):
        f = result["figures"][phase]
        rows.append([phase, fmt_ms(f["tpot_p50_s"]), fmt_ms(f["tpot_p99_s"]), str(f["tokens"])])
    rows.append(["burst / idle", f"{result['ratio_p50']:.2f}x", f"{result['ratio_p99']:.2f}x", ""])
    print(format_table(rows))
    met = "met" if result["ratio_p99"] <= GOAL_RATIO else "not met"
    print(
        f"goal: p99 within {GOAL_RATIO}x of idle: {met}; canaries exact: {result['canaries_exact']}"
    )
    rows = [["hostile class", "rounds", "outcomes", "unexpected", "5xx"]]
    for name, c in result["hostile"].items():
        outcomes = " ".join(f"{o}:{n}" for o, n in sorted(c["outcomes"].items()))
        rows.append([name, str(c["rounds"]), outcomes, str(c["unexpected"]), str(c["5xx"])])
    print(format_table(rows))
    out = start.provenance(args) | {"args": args_json(args), **result}
    write_result(args.out, RESULT_NAME, out, lambda path: plot(path, result))
    clean = all(c["unexpected"] == 0 for c in result["hostile"].values())
    return 0 if result["canaries_exact"] and clean else 1


if __name__ == "__main__":
    sys.exit(main())
