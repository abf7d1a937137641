"""Gateway overhead: the time the HTTP gateway adds per token and to the first token.

The same greedy workload (waves of C concurrent requests with short fixed prompts, each
producing exactly --max-tokens tokens with EOS ignored) runs three ways in one run, on three
engines with identical settings:

* core:   `EngineCore` in this process, `step()` in a loop: the engine alone;
* client: `AsyncEngineClient`, the engine in its own process behind ZMQ (what the gateway
          uses), driven from this process's event loop;
* http:   `tokenfleet serve` as a subprocess on 127.0.0.1, streaming `/v1/completions` with
          token-id prompts over raw keep-alive HTTP/1.1 connections, the SSE events
          parsed here.

Per request it records when it was sent and when each token arrived (core: when `step()`
returned it; client: when `generate` yielded it; http: when its SSE event was read), so
TTFT = first token - sent and TPOT = the gaps between consecutive tokens. Modes run
interleaved, round after round (their order rotated each round), and each figure is the
median over rounds of that round's median (or p90). Added time = a mode's figure minus the
core's: http - core is the gateway's whole cost, client - core the process boundary alone.
Those differences compare different requests on different engines, and this machine's
steps vary by more than the goals from wave to wave; so it also pairs each wave's requests
with what the servers themselves recorded for the same requests: the engine's own TTFT
(from the start of the first step after it took a request to the end of the step with
its first token, in /metrics) and the gateway's own TTFT and TPOT. Client mean minus the
engine's own mean is the whole gateway's cost at the first token (HTTP layer and process
boundary), with the engine's time cancelled out; client minus the gateway's own is the
HTTP layer alone.
It also reads the CPU time every process spent (bench, gateway, engine) from /proc, per
output token, and how much CPU other processes took meanwhile (noise).

    .venv/bin/python bench/gateway_overhead.py                          # the full benchmark
    .venv/bin/python bench/gateway_overhead.py --rounds 1 --max-tokens 16 --out /tmp/bench

Writes `gateway_overhead.json` and `gateway_overhead.png` into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import math
import os
import re
import shlex
import socket
import statistics
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import torch
from common.results import BUSY_WARNING, args_json, cpu_busy_fraction, format_table, machine_info
from common.server import tokenfleet_serve
from common.stats import percentile
from tqdm import tqdm

from tokenfleet import envs
from tokenfleet.checkpoint.bundled import prepare_bundled_model
from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.engine.client import AsyncEngineClient
from tokenfleet.engine.core import EngineCore

RESULT_NAME = "gateway_overhead"
SERVED_MODEL_NAME = "smollm2-135m-instruct"
MODES = ("core", "client", "http")
MODE_NAMES = {
    "core": "engine core (in-process)",
    "client": "engine process (ZMQ client)",
    "http": "HTTP gateway (serve)",
}
MODE_COLORS = {"core": "tab:blue", "client": "tab:orange", "http": "tab:green"}
GOAL_TPOT_MS = 1.0  # the gateway may add at most this per token...
GOAL_TTFT_MS = 5.0  # ...and this to the first token
MAX_NUM_BATCHED_TOKENS = 512
BLOCK_SIZE = 16
# English text, so that (nearly) every greedy output token decodes to text of its own and
# gets its own SSE event: a token ending inside a UTF-8 character would be held back.
PROMPT_TEXT = (
    "Tale number {i}. Once upon a time, in a small village by the sea, there lived an old "
    "fisherman who went out every morning before dawn. One day, as the sun rose over the "
    "water, he saw something shining beneath the waves, and he leaned over the side of his "
    "boat to look more closely."
)
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- workload ----------------------------------------------------------------------------


def make_prompts(tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of exactly `length` token ids."""
    prompts = []
    for i in range(count):
        ids = tokenizer.encode(PROMPT_TEXT.format(i=i))
        while len(ids) < length:
            ids += ids
        prompts.append(ids[:length])
    return prompts


@dataclass
class RequestTiming:
    """One request: when it was sent and when each token arrived, in seconds on one clock
    (core and client: perf_counter; http: kernel_clock, the kernel's receive stamps')."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0  # tokens generated (http: from the usage chunk)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass
class RoundResult:
    mode: str
    concurrency: int
    round: int
    requests: list[RequestTiming]
    wall_s: float
    cpu_s: dict[str, float]  # process role -> CPU seconds during the round
    other_cpu_share: float | None  # share of the machine's CPUs that other processes used
    # http only: the mean TTFT the gateway itself recorded for these requests (/metrics:
    # from its service layer taking the request to the engine's first output arriving),
    # and its mean TPOT (between the engine's outputs arriving)
    gateway_ttft_mean_ms: float | None = None
    gateway_tpot_mean_ms: float | None = None
    # client and http: the mean TTFT the engine process itself recorded for these requests
    # (from the start of the first step after it took each to the end of the step with its
    # first token)
    engine_ttft_mean_ms: float | None = None

    @property
    def output_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    def ttfts_ms(self) -> list[float]:
        return [1e3 * r.ttft for r in self.requests]

    def gaps_ms(self) -> list[float]:
        return [1e3 * g for r in self.requests for g in r.gaps]

    def summary(self) -> dict[str, float]:
        ttft, gaps = self.ttfts_ms(), self.gaps_ms()
        return {
            "ttft_min_ms": min(ttft),
            "ttft_mean_ms": statistics.mean(ttft),
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p90_ms": percentile(ttft, 90),
            "tpot_mean_ms": statistics.mean(gaps),
            "tpot_p50_ms": percentile(gaps, 50),
            "tpot_p90_ms": percentile(gaps, 90),
            "output_tokens_per_s": self.output_tokens / self.wall_s,
        }


# -- CPU accounting ----------------------------------------------------------------------


def proc_cpu_s(pid: int | str) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_s() -> float:
    """CPU seconds all processes have spent, summed over every CPU, from /proc/stat."""
    with open("/proc/stat") as f:
        # user nice system idle iowait irq softirq steal (guest time is already in user)
        values = [int(x) for x in f.readline().split()[1:9]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values) - idle) / CLK_TCK


class CpuMeter:
    """CPU time of named processes, and of everything else on the machine, over a span."""

    def __init__(self, pids: dict[str, int | str]) -> None:
        self.pids = pids

    def sample(self) -> tuple[float, dict[str, float], float]:
        return (
            time.perf_counter(),
            {k: proc_cpu_s(p) for k, p in self.pids.items()},
            machine_busy_s(),
        )

    def since(
        self, start: tuple[float, dict[str, float], float]
    ) -> tuple[dict[str, float], float | None]:
        t0, ours0, busy0 = start
        t1, ours1, busy1 = self.sample()
        ours = {k: ours1[k] - ours0[k] for k in ours1}
        wall = t1 - t0
        cpus = os.cpu_count() or 1
        other = (busy1 - busy0 - sum(ours.values())) / (wall * cpus) if wall > 0 else None
        return ours, None if other is None else max(0.0, other)


class _Span:
    """One mode's waves in a round, measured one by one: their requests, wall time, CPU
    time, and the latency sums the servers recorded for the same requests: the engine's own
    TTFT (client and http) and the gateway's own TTFT and TPOT (http)."""

    def __init__(self) -> None:
        self.requests: list[RequestTiming] = []
        self.wall_s = 0.0
        self.cpu_s: dict[str, float] = {}
        self.other_cpu_s: float | None = 0.0  # share x wall, summed
        # name -> (seconds, count) summed over the waves; None once a wave's counts did not
        # match its requests (other requests got in: no paired figure)
        self.recorded: dict[str, tuple[float, int]] | None = {}

    async def measure(
        self,
        wave: Awaitable[list[RequestTiming]],
        meter: CpuMeter,
        recorded: Callable[[], Awaitable[dict[str, tuple[float, int]]]] | None,
    ) -> None:
        before = await recorded() if recorded is not None else None
        start = meter.sample()
        requests = await wave
        cpu_s, other = meter.since(start)
        wall_s = time.perf_counter() - start[0]
        self.requests += requests
        self.wall_s += wall_s
        for role, seconds in cpu_s.items():
            self.cpu_s[role] = self.cpu_s.get(role, 0.0) + seconds
        if other is None or self.other_cpu_s is None:
            self.other_cpu_s = None
        else:
            self.other_cpu_s += other * wall_s
        if before is None or recorded is None or self.recorded is None:
            return
        after = await recorded()
        ttft_counts = {after[k][1] - before[k][1] for k in after if k.endswith("ttft")}
        if ttft_counts != {len(requests)}:
            self.recorded = None
            return
        for key in after:
            seconds, count = self.recorded.get(key, (0.0, 0))
            self.recorded[key] = (
                seconds + after[key][0] - before[key][0],
                count + after[key][1] - before[key][1],
            )

    def result(self, mode: str, concurrency: int, round_index: int) -> RoundResult:
        other = None
        if self.other_cpu_s is not None and self.wall_s > 0:
            other = self.other_cpu_s / self.wall_s
        means = {
            key: 1e3 * seconds / count
            for key, (seconds, count) in (self.recorded or {}).items()
            if count
        }
        return RoundResult(
            mode,
            concurrency,
            round_index,
            self.requests,
            self.wall_s,
            self.cpu_s,
            other,
            gateway_ttft_mean_ms=means.get("gateway_ttft"),
            gateway_tpot_mean_ms=means.get("gateway_tpot"),
            engine_ttft_mean_ms=means.get("engine_ttft"),
        )


# -- the three ways of serving a wave ----------------------------------------------------


def core_wave(
    core: EngineCore, prompts: list[list[int]], params: SamplingParams
) -> list[RequestTiming]:
    """Add every request, then step until all finish; a token arrives when step() returns."""
    timings: dict[str, RequestTiming] = {}
    for prompt in prompts:
        req_id = uuid.uuid4().hex
        timings[req_id] = RequestTiming(time.perf_counter())
        core.add_request(EngineCoreRequest(req_id, prompt, params, time.monotonic()))
    while core.has_unfinished_requests():
        out = core.step()
        now = time.perf_counter()
        for o in out.outputs:
            if o.new_token_ids:
                timing = timings[o.req_id]
                timing.token_times.append(now)
                timing.num_tokens += len(o.new_token_ids)
    return list(timings.values())


async def client_wave(
    client: AsyncEngineClient, prompts: list[list[int]], params: SamplingParams
) -> list[RequestTiming]:
    async def one(prompt: list[int], num_pending: int) -> RequestTiming:
        timing = RequestTiming(time.perf_counter())
        request = EngineCoreRequest(uuid.uuid4().hex, prompt, params, time.monotonic())
        # As the gateway does: each request says how many of the wave are still to come.
        async with contextlib.aclosing(await client.submit(request, num_pending)) as outputs:
            async for out in outputs:
                if out.new_token_ids:
                    timing.token_times.append(time.perf_counter())
                    timing.num_tokens += len(out.new_token_ids)
        return timing

    last = len(prompts) - 1
    return list(await asyncio.gather(*(one(p, last - i) for i, p in enumerate(prompts))))


# The end of a chunked response (its zero-size last chunk), and a status line that is not
# 200 (an error reply: read it at once).
_LAST_CHUNK = b"\r\n0\r\n\r\n"
_NOT_OK = re.compile(rb"^HTTP/1\.1 (?!200)")
_TIMESPEC = struct.Struct("@ll")  # SCM_TIMESTAMPNS: seconds, nanoseconds (CLOCK_REALTIME)


def kernel_clock() -> float:
    """Now, on the clock of the kernel's receive timestamps (CLOCK_REALTIME), in seconds."""
    return time.time_ns() / 1e9


class _Arrivals:
    """The bytes of one connection, each chunk stamped by the kernel when it arrived there
    (SO_TIMESTAMPNS), not when this process got round to reading it: 32 streams' first
    events arrive together while the engine and the gateway hold both cores, and this
    process may read them only once the gateway has written them all.

    The reader is woken only when a response is complete (or cannot be: an error status,
    a closed connection), and parses it then from the stamps, so that this process does
    little work while the gateway writes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.chunks: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = asyncio.Event()
        self.closed = False
        self.wake_on_any = False  # wake the reader on every chunk (a plain reply)

    def on_readable(self) -> None:
        ancillary = socket.CMSG_SPACE(_TIMESPEC.size)
        while True:
            try:
                data, cmsgs, _, _ = self.sock.recvmsg(1 << 16, ancillary)
            except BlockingIOError:
                return
            except OSError:
                data, cmsgs = b"", []
            if not data:
                self.closed = True
                self.ready.set()
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
                return
            stamp = kernel_clock()
            for level, kind, value in cmsgs:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    seconds, nanoseconds = _TIMESPEC.unpack(value[: _TIMESPEC.size])
                    stamp = seconds + nanoseconds / 1e9
            self.chunks.append((stamp, data))
            if (
                self.wake_on_any
                or data.endswith(_LAST_CHUNK)
                or (len(self.chunks) == 1 and _NOT_OK.match(data))
            ):
                self.ready.set()


SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux


class SSEConnection:
    """One keep-alive HTTP/1.1 connection to the gateway, on a raw non-blocking socket.

    Requests are encoded before the clock starts and written without awaiting, so a wave
    of 32 reaches the gateway within microseconds, as 32 independent callers' would. (With
    httpx, the client spent about a millisecond per request: a burst of 32 left it over
    tens of ms, and that spread was counted as the gateway's.) A token's time is when the
    bytes that complete its event reached this machine's kernel (_Arrivals), on the same
    clock as the request's sent time (kernel_clock): not when this process got round to
    reading or parsing them, which would add this client's own work and its wait for a
    core to the gateway's figures.
    """

    KEEPALIVE_S = 3.0  # uvicorn closes idle keep-alive connections after 5 s

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.sock: socket.socket | None = None
        self.arrivals: _Arrivals | None = None
        self.buffer = b""  # received, not yet parsed
        self.buffer_time = 0.0  # arrival of the last chunk in `buffer`
        self.last_used = 0.0

    async def ensure_open(self) -> None:
        fresh = time.monotonic() - self.last_used < self.KEEPALIVE_S
        arrivals = self.arrivals
        if self.sock is not None and arrivals is not None and fresh and not arrivals.closed:
            return
        self.close()
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setblocking(False)
        await loop.sock_connect(sock, (self.host, self.port))
        self.sock, self.arrivals, self.buffer = sock, _Arrivals(sock), b""
        loop.add_reader(sock.fileno(), self.arrivals.on_readable)
        # One round trip before it carries a measured request: the connect returns once the
        # kernel has the connection, before the gateway's event loop took it in, and a burst
        # on 32 new connections would otherwise race their setup (a request whose
        # connection is still being set up comes late and may miss the burst's first step).
        self.arrivals.wake_on_any = True
        self.send(f"GET /health HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n\r\n".encode())
        head, _ = await self.read_until(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        await self.read_exactly(int(length.group(1)) if length else 0)
        self.arrivals.wake_on_any = False
        self.last_used = time.monotonic()

    def close(self) -> None:
        if self.sock is not None:
            if self.arrivals is not None and not self.arrivals.closed:
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
        self.sock = self.arrivals = None

    def request_bytes(self, path: str, body: dict[str, Any]) -> bytes:
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        )
        return head.encode() + payload

    def send(self, data: bytes) -> None:
        assert self.sock is not None
        sent = self.sock.send(data)  # a few hundred bytes into an empty socket buffer
        if sent != len(data):
            raise ConnectionError(f"short write: {sent} of {len(data)} bytes")

    async def _more(self) -> None:
        """Move the next arrived chunk into the buffer (waiting for one if need be)."""
        arrivals = self.arrivals
        assert arrivals is not None
        while not arrivals.chunks:
            if arrivals.closed:
                raise ConnectionError("the gateway closed the connection")
            arrivals.ready.clear()
            await arrivals.ready.wait()
        self.buffer_time, chunk = arrivals.chunks.popleft()
        self.buffer += chunk

    async def read_until(self, separator: bytes) -> tuple[bytes, float]:
        """Bytes up to and including `separator`, and when its last byte arrived."""
        while (end := self.buffer.find(separator)) < 0:
            await self._more()
        end += len(separator)
        data, self.buffer = self.buffer[:end], self.buffer[end:]
        return data, self.buffer_time

    async def read_exactly(self, size: int) -> tuple[bytes, float]:
        while len(self.buffer) < size:
            await self._more()
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data, self.buffer_time

    async def read_stream(self, timing: RequestTiming) -> RequestTiming:
        """Read one chunked SSE response to `data: [DONE]`, timing each token's event."""
        head, _ = await self.read_until(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {head.decode(errors='replace')}")
        if b"transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"expected a chunked stream: {head.decode(errors='replace')}")
        events = b""
        while True:
            size_line, _ = await self.read_until(b"\r\n")
            size = int(size_line.strip(), 16)
            chunk, arrived = await self.read_exactly(size + 2)
            if size == 0:
                raise RuntimeError("the stream ended without data: [DONE]")
            events += chunk[:-2]
            *complete, events = events.split(b"\n\n")
            for event in complete:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:]
                    if payload == b"[DONE]":
                        await self.read_exactly(5)  # the closing 0-size chunk: 0\r\n\r\n
                        self.last_used = time.monotonic()
                        return timing
                    data = json.loads(payload)
                    if "error" in data:
                        raise RuntimeError(f"error event: {data['error']}")
                    if data["choices"]:
                        timing.token_times.append(arrived)
                    if data.get("usage"):
                        timing.num_tokens = data["usage"]["completion_tokens"]


# The benchmark's CPU priority (nice) while it writes a wave's requests, and while it reads
# their replies (http_wave). Where it may, it writes under SCHED_FIFO instead (below).
SEND_NICE = -5
READ_NICE = 10
SEND_FIFO_PRIORITY = 1


def can_renice() -> bool:
    """Whether this process may raise its own CPU priority (root, or CAP_SYS_NICE)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, SEND_NICE)
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        return False
    return True


def burst_writer(renice: bool) -> str:
    """How http_wave writes a wave's requests, decided once: at real-time priority
    ("SCHED_FIFO"), so that no other process of this machine (the gateway, the engine,
    their I/O threads) takes the core from the writer in the middle of the burst, as none
    would from a client on another machine; at nice SEND_NICE where SCHED_FIFO is not
    allowed (a raised nice value still let the gateway, woken by the first request, take
    the core now and then, and the engine then started on that request alone: about one
    wave in ten); "default" without `renice`."""
    if not renice:
        return "default"
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(SEND_FIFO_PRIORITY))
    except (PermissionError, AttributeError):
        return f"nice {SEND_NICE}"
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return "SCHED_FIFO"


@contextlib.contextmanager
def writing_burst(writer: str) -> Any:
    """The block writes a wave's requests as `writer` (burst_writer) says."""
    if writer != "SCHED_FIFO":
        with niceness(None if writer == "default" else SEND_NICE):
            yield
        return
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(SEND_FIFO_PRIORITY))
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


@contextlib.contextmanager
def niceness(value: int | None) -> Any:
    """This thread's nice value `value` within the block, 0 after (None: left alone)."""
    if value is None:
        yield
        return
    os.setpriority(os.PRIO_PROCESS, 0, value)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, 0)


async def http_wave(
    connections: list[SSEConnection],
    prompts: list[list[int]],
    max_tokens: int,
    renice: bool = False,
    writer: str = "default",
) -> list[RequestTiming]:
    """Every request written at once on its own keep-alive connection, then all read.

    With `renice`, the requests are written at a higher CPU priority than the gateway's
    (`writer`, burst_writer) and the replies read at a lower one. This machine's clients share its
    two cores with the gateway, where real ones would be elsewhere: each write wakes the
    gateway, which would otherwise take the core from the writer after its first request
    or two and parse them while the rest of the burst waits in this process (the burst
    then reaches the gateway in pieces), and each event the gateway writes wakes a reader
    here, which would take the core from the gateway in the middle of writing the other
    streams' events. The times are the kernel's (_Arrivals), so reading late changes none
    of them."""
    for conn in connections[: len(prompts)]:
        await conn.ensure_open()
    requests = [
        conn.request_bytes(
            "/v1/completions",
            {
                "model": SERVED_MODEL_NAME,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        for conn, prompt in zip(connections, prompts, strict=False)
    ]
    timings = []
    with writing_burst(writer):
        for conn, data in zip(connections, requests, strict=False):
            timings.append(RequestTiming(kernel_clock()))  # the clock of the arrival stamps
            conn.send(data)
    with niceness(READ_NICE if renice else None):
        return list(
            await asyncio.gather(
                *(conn.read_stream(t) for conn, t in zip(connections, timings, strict=False))
            )
        )


# -- results -----------------------------------------------------------------------------

METRICS = (
    "ttft_min_ms",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "output_tokens_per_s",
)
LATENCIES = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


_RECORDED = {
    "tokenfleet_time_to_first_token_seconds": "gateway_ttft",
    "tokenfleet_time_per_output_token_seconds": "gateway_tpot",
    "tokenfleet_engine_time_to_first_token_seconds": "engine_ttft",
}


async def gateway_latency(http: httpx.AsyncClient) -> dict[str, tuple[float, int]]:
    """From /metrics, (sum of seconds, count) over every label set of: the gateway's own
    TTFT and TPOT histograms, and the engine's own TTFT summary."""
    text = (await http.get("/metrics")).text
    sums = dict.fromkeys(_RECORDED.values(), 0.0)
    counts = dict.fromkeys(_RECORDED.values(), 0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        family, _, _ = name.partition("{")
        if family.endswith("_sum") and family.removesuffix("_sum") in _RECORDED:
            sums[_RECORDED[family.removesuffix("_sum")]] += float(value)
        elif family.endswith("_count") and family.removesuffix("_count") in _RECORDED:
            counts[_RECORDED[family.removesuffix("_count")]] += int(float(value))
    return {key: (sums[key], counts[key]) for key in sums}


def engine_latency(client: AsyncEngineClient) -> dict[str, tuple[float, int]]:
    """The engine's own TTFT (sum of seconds, count), from its latest step message."""
    stats = client.stats
    if stats is None:
        return {"engine_ttft": (0.0, 0)}
    return {
        "engine_ttft": (
            sum(stats.ttft_sum_s_by_class.values()),
            sum(stats.ttft_count_by_class.values()),
        )
    }


def summarize(rounds: list[RoundResult], concurrencies: Sequence[int]) -> dict[str, Any]:
    """Per concurrency and mode: medians over rounds of each round's figures, CPU per token,
    and the time each mode adds to the core's (differences of those medians)."""
    out: dict[str, Any] = {}
    for c in concurrencies:
        modes: dict[str, Any] = {}
        for mode in MODES:
            rs = [r for r in rounds if r.mode == mode and r.concurrency == c]
            per_round = [r.summary() for r in rs]
            tokens = sum(r.output_tokens for r in rs)
            roles = rs[0].cpu_s.keys() if rs else []
            others = [r.other_cpu_share for r in rs if r.other_cpu_share is not None]
            modes[mode] = {
                **{m: statistics.median(s[m] for s in per_round) for m in METRICS},
                "per_round": per_round,
                "cpu_ms_per_token": {
                    role: 1e3 * sum(r.cpu_s[role] for r in rs) / tokens for role in roles
                },
                "other_processes_cpu_share": statistics.mean(others) if others else None,
                "requests": sum(len(r.requests) for r in rs),
                "output_tokens": tokens,
                "tokens_without_own_event": sum(
                    q.num_tokens - len(q.token_times) for r in rs for q in r.requests
                ),
            }
        added: dict[str, Any] = {}
        for name, mode, base in (
            ("http_minus_core", "http", "core"),
            ("client_minus_core", "client", "core"),
            ("http_minus_client", "http", "client"),
        ):
            added[name] = {m: modes[mode][m] - modes[base][m] for m in LATENCIES}
            # The same difference round by round (a round's modes ran back to back): half
            # its range over the rounds is the noise the verdicts allow for.
            pairs = list(zip(modes[mode]["per_round"], modes[base]["per_round"], strict=True))
            for m in LATENCIES:
                diffs = [a[m] - b[m] for a, b in pairs]
                added[name][f"{m}_per_round"] = diffs
                added[name][f"{m}_noise"] = (
                    (max(diffs) - min(diffs)) / 2 if len(diffs) > 1 else None
                )
        http_rounds = [r for r in rounds if r.mode == "http" and r.concurrency == c]
        client_rounds = [r for r in rounds if r.mode == "client" and r.concurrency == c]
        core_rounds = {r.round: r for r in rounds if r.mode == "core" and r.concurrency == c}
        out[str(c)] = {
            "modes": modes,
            "added": added,
            # Paired within the same requests, so the engine's own time cancels out: the
            # client's mean against the mean the server itself recorded for them.
            # The whole gateway (HTTP layer, process boundary) against the engine's own TTFT:
            "gateway_ttft": _paired(
                [(r.summary()["ttft_mean_ms"], r.engine_ttft_mean_ms) for r in http_rounds]
            ),
            # the process boundary alone (ZMQ, the client's event loop):
            "process_ttft": _paired(
                [(r.summary()["ttft_mean_ms"], r.engine_ttft_mean_ms) for r in client_rounds]
            ),
            # the HTTP layer alone, against the gateway's own TTFT and TPOT:
            "http_layer_ttft": _paired(
                [(r.summary()["ttft_mean_ms"], r.gateway_ttft_mean_ms) for r in http_rounds]
            ),
            "http_layer_tpot": _paired(
                [(r.summary()["tpot_mean_ms"], r.gateway_tpot_mean_ms) for r in http_rounds]
            ),
            # Not paired (other requests, same round): is the engine slower in its own
            # process beside the gateway than the core in this one? The engine's own mean
            # TTFT in the http waves minus the core's mean TTFT.
            "engine_process_vs_core_ttft": _paired(
                [
                    (r.engine_ttft_mean_ms, core_rounds[r.round].summary()["ttft_mean_ms"])
                    for r in http_rounds
                    if r.engine_ttft_mean_ms is not None and r.round in core_rounds
                ]
            ),
        }
    return out


def _paired(rounds: list[tuple[float | None, float | None]]) -> dict[str, Any] | None:
    """A mean minus another (the client's minus the server's own), round by round: their
    median, and half their range as the noise."""
    pairs = [(a, b) for a, b in rounds if a is not None and b is not None]
    if not pairs:
        return None
    diffs = [a - b for a, b in pairs]
    return {
        "client_mean_ms": statistics.median(a for a, _ in pairs),
        "recorded_mean_ms": statistics.median(b for _, b in pairs),
        "added_ms": statistics.median(diffs),
        "added_ms_per_round": diffs,
        "noise_ms": (max(diffs) - min(diffs)) / 2 if len(diffs) > 1 else None,
    }


def verdict(value: float, noise: float | None, goal: float) -> str:
    """'met' or 'not met' only when the round-to-round noise cannot flip it."""
    if noise is None:
        return ("met" if value < goal else "not met") + " (one round: noise unknown)"
    if value + noise < goal:
        return "met"
    if value - noise >= goal:
        return "not met"
    return "inconclusive"


def fmt_noise(noise: float | None) -> str:
    return "?" if noise is None else f"{noise:.2f}"


def goals(summary: dict[str, Any]) -> dict[str, Any]:
    result = {}
    for c, s in summary.items():
        added = s["added"]["http_minus_core"]
        for name, metric, goal in (
            ("tpot", "tpot_p50_ms", GOAL_TPOT_MS),
            ("ttft", "ttft_p50_ms", GOAL_TTFT_MS),
        ):
            value, noise = added[metric], added[f"{metric}_noise"]
            result[f"{name}_added_at_{c}"] = {
                "value_ms": value,
                "noise_ms": noise,
                "goal_ms": goal,
                "met": value < goal,
                "verdict": verdict(value, noise, goal),
            }
            for part in ("gateway", "http_layer"):
                paired = s.get(f"{part}_{name}")
                if paired is not None:
                    value, noise = paired["added_ms"], paired["noise_ms"]
                    result[f"{name}_{part}_at_{c}"] = {
                        "value_ms": value,
                        "noise_ms": noise,
                        "goal_ms": goal,
                        "met": value < goal,
                        "verdict": verdict(value, noise, goal),
                    }
    return result


def round_to_json(r: RoundResult) -> dict[str, Any]:
    return {
        "mode": r.mode,
        "concurrency": r.concurrency,
        "round": r.round,
        "wall_s": r.wall_s,
        "cpu_s": r.cpu_s,
        "other_processes_cpu_share": r.other_cpu_share,
        "gateway_ttft_mean_ms": r.gateway_ttft_mean_ms,
        "gateway_tpot_mean_ms": r.gateway_tpot_mean_ms,
        "engine_ttft_mean_ms": r.engine_ttft_mean_ms,
        **r.summary(),
        "requests": [
            {
                "ttft_ms": round(1e3 * q.ttft, 3),
                "num_tokens": q.num_tokens,
                "token_ms": [round(1e3 * (t - q.sent), 3) for t in q.token_times],
            }
            for q in r.requests
        ],
    }


def plot(path: Path, rounds: list[RoundResult], summary: dict[str, Any]) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    concurrencies = [int(c) for c in summary]
    fig = Figure(figsize=(15, 4.2 * len(concurrencies)), layout="constrained")
    axes = fig.subplots(len(concurrencies), 3, squeeze=False)
    for row, c in zip(axes, concurrencies, strict=True):
        ttft_ax, tpot_ax, added_ax = row
        for mode in MODES:
            rs = [r for r in rounds if r.mode == mode and r.concurrency == c]
            for ax, values in (
                (ttft_ax, [v for r in rs for v in r.ttfts_ms()]),
                (tpot_ax, [v for r in rs for v in r.gaps_ms()]),
            ):
                if values:
                    xs = np.sort(values)
                    ys = np.arange(1, len(xs) + 1) / len(xs)
                    ax.step(xs, ys, where="post", color=MODE_COLORS[mode], label=MODE_NAMES[mode])
        ttft_ax.set_title(f"time to first token, {c} stream{'s' if c > 1 else ''}")
        ttft_ax.set_xlabel("ms")
        tpot_ax.set_title(f"time between tokens, {c} stream{'s' if c > 1 else ''}")
        tpot_ax.set_xlabel("ms")
        tpot_p99 = max(
            (percentile(r.gaps_ms(), 99) for r in rounds if r.concurrency == c), default=0
        )
        if tpot_p99 > 0:
            tpot_ax.set_xlim(0, 1.2 * tpot_p99)
        for ax in (ttft_ax, tpot_ax):
            ax.set_ylabel("fraction of samples")
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right", fontsize="small")

        added = summary[str(c)]["added"]
        labels = ["TTFT", "TPOT"]
        x = np.arange(len(labels))
        for k, (name, mode) in enumerate(
            (("client_minus_core", "client"), ("http_minus_core", "http"))
        ):
            values = [added[name]["ttft_p50_ms"], added[name]["tpot_p50_ms"]]
            noise = [added[name][f"{m}_noise"] or 0.0 for m in ("ttft_p50_ms", "tpot_p50_ms")]
            rects = added_ax.bar(
                x + (k - 0.5) * 0.35,
                values,
                0.35,
                yerr=noise,
                capsize=4,
                color=MODE_COLORS[mode],
                label=MODE_NAMES[mode],
            )
            added_ax.bar_label(rects, fmt="%+.1f", fontsize="small", label_type="center")
        for i, goal in enumerate((GOAL_TTFT_MS, GOAL_TPOT_MS)):
            added_ax.hlines(goal, i - 0.4, i + 0.4, colors="red", linestyles="dashed")
        added_ax.axhline(0, color="black", linewidth=0.8)
        added_ax.set_yscale("symlog", linthresh=1)
        added_ax.set_xticks(x, labels)
        added_ax.set_ylabel("ms over the engine core's median (symlog)")
        added_ax.set_title(
            f"added time (p50), {c} stream{'s' if c > 1 else ''}; bars: noise, red: goal"
        )
        added_ax.legend(loc="best", fontsize="small")
    fig.savefig(path, dpi=110)


# -- main --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default=None, help="Hugging Face model folder; none: the bundled model")
    add("--rounds", type=int, default=3, help="measured rounds of every mode and concurrency")
    add("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    add("--prompt-len", type=int, default=16, help="prompt tokens per request")
    add("--concurrency", type=int, nargs="+", default=[1, 32], help="streams at once")
    add(
        "--min-requests",
        type=int,
        default=8,
        help="per round, waves of C requests run until at least this many ran",
    )
    add("--min-waves", type=int, default=3, help="and at least this many waves")
    add("--threads", type=int, default=1, help="torch threads of every engine")
    add("--kv-cache-memory", type=int, default=256 << 20, help="KV cache bytes of every engine")
    add(
        "--no-renice",
        action="store_true",
        help="write and read at the default CPU priority (http_wave's renice off)",
    )
    add("--out", type=Path, default=Path("bench/results"), help="folder for JSON and PNG")
    args = parser.parse_args(argv)
    for name in ("rounds", "max_tokens", "prompt_len", "min_requests", "min_waves", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2 (TPOT needs two tokens)")
    if any(c < 1 for c in args.concurrency):
        parser.error("--concurrency values must be at least 1")
    args.concurrency = sorted(set(args.concurrency))
    return args


def waves_per_round(concurrency: int, args: argparse.Namespace) -> int:
    return max(math.ceil(args.min_requests / concurrency), args.min_waves)


async def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    max_c = max(args.concurrency)
    engine_config = EngineConfig(
        model=str(folder),
        num_threads=args.threads,
        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=max(64, max_c)
        ),
    )
    serve_args = [
        "--model",
        str(folder),
        "--num-threads",
        str(args.threads),
        "--kv-cache-memory",
        str(args.kv_cache_memory),
        "--no-prefix-caching",
        "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS),
        "--max-num-seqs",
        str(max(64, max_c)),
        "--ttft-target",
        "3600",  # admission control off: the benchmark must never be refused
    ]
    tokenizer = Tokenizer(folder)
    prompts = make_prompts(tokenizer, max_c, args.prompt_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prime_params = msgspec.structs.replace(params, max_tokens=2)

    print("loading: engine core in-process, engine process, tokenfleet serve ...")
    t0 = time.perf_counter()
    core = EngineCore(engine_config)
    need_blocks = max_c * math.ceil((args.prompt_len + args.max_tokens) / BLOCK_SIZE)
    if core.kv.pool.num_blocks < need_blocks:
        raise SystemExit(
            f"--kv-cache-memory holds {core.kv.pool.num_blocks} blocks; {max_c} requests of "
            f"{args.prompt_len} + {args.max_tokens} tokens need {need_blocks} (raise it)"
        )
    async with AsyncExitStack() as stack:
        log_dir = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="tokenfleet-gateway-bench-"))
        )
        # The event loop is blocked while the core runs in-process: never take that for a
        # silent engine.
        client = AsyncEngineClient(engine_config, heartbeat_timeout_s=24 * 3600)
        await client.start()
        stack.push_async_callback(client.shutdown)
        # Started before any load: the loop has nothing else to do while it waits.
        gateway = stack.enter_context(tokenfleet_serve("gateway", log_dir, serve_args))
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=gateway.url, timeout=600)
        )  # /metrics only; the streams go over `connections`
        host, port = gateway.url.removeprefix("http://").split(":")
        connections = [SSEConnection(host, int(port)) for _ in range(max_c)]
        stack.callback(lambda: [conn.close() for conn in connections])
        load_s = time.perf_counter() - t0
        renice = not args.no_renice and can_renice()
        writer = burst_writer(renice)
        if not args.no_renice and not renice:
            print(
                "warning: may not raise this process's CPU priority (not root, no "
                "CAP_SYS_NICE): the http mode's writes and reads share the cores at the "
                "default priority, and the HTTP figures include the benchmark's own waits",
                file=sys.stderr,
            )
        assert client.pid is not None
        meters = {
            "core": CpuMeter({"bench": "self"}),
            "client": CpuMeter({"bench": "self", "engine": client.pid}),
            "http": CpuMeter(
                {
                    "bench": "self",
                    "gateway": gateway.process.pid,
                    "engine": int(gateway.ready["engine_pid"]),
                }
            ),
        }

        async def client_recorded() -> dict[str, tuple[float, int]]:
            return engine_latency(client)

        async def http_recorded() -> dict[str, tuple[float, int]]:
            return await gateway_latency(http)

        recorded = {"core": None, "client": client_recorded, "http": http_recorded}

        def wave_fn(mode: str, p: SamplingParams) -> Callable[[list[list[int]]], Awaitable[Any]]:
            async def go(batch: list[list[int]]) -> list[RequestTiming]:
                if mode == "core":
                    return core_wave(core, batch, p)
                if mode == "client":
                    return await client_wave(client, batch, p)
                return await http_wave(connections, batch, p.max_tokens, renice, writer)

            return go

        # Warm-up: every path once at every concurrency (kernels, allocator, connections).
        for c in args.concurrency:
            for mode in MODES:
                await wave_fn(
                    mode, msgspec.structs.replace(params, max_tokens=min(8, args.max_tokens))
                )(prompts[:c])

        total = sum(waves_per_round(c, args) * c * args.max_tokens for c in args.concurrency)
        bar = tqdm(total=total * len(MODES) * args.rounds, desc="tokens", unit="tok")
        rounds: list[RoundResult] = []
        for r in range(args.rounds):
            for c in args.concurrency:
                order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
                for mode in order:
                    # A short wave first: the process wakes up and (http) C connections open.
                    await wave_fn(mode, prime_params)(prompts[:c])
                spans = {mode: _Span() for mode in order}
                # Modes take turns wave by wave (each wave's order rotated too), so that a
                # slow spell of the machine falls on every mode alike, not on one.
                for w in range(waves_per_round(c, args)):
                    turn = w % len(order)
                    for mode in order[turn:] + order[:turn]:
                        bar.set_postfix_str(f"round {r + 1}/{args.rounds}, C={c}, {mode}")
                        await spans[mode].measure(
                            wave_fn(mode, params)(prompts[:c]), meters[mode], recorded[mode]
                        )
                        bar.update(c * args.max_tokens)
                for mode in order:
                    span = spans[mode]
                    for q in span.requests:
                        if q.num_tokens != args.max_tokens or not q.token_times:
                            raise RuntimeError(
                                f"{mode}: a request got {q.num_tokens} tokens "
                                f"({len(q.token_times)} events), wanted {args.max_tokens}"
                            )
                    rounds.append(span.result(mode, c, r))
        bar.close()
    return {
        "rounds": rounds,
        "load_s": load_s,
        "serve_args": serve_args,
        "config": engine_config,
        "renice": renice,
        "burst_writer": writer,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    busy_before = cpu_busy_fraction()
    if busy_before is not None and busy_before > BUSY_WARNING:
        print(
            f"warning: {100 * busy_before:.0f}% of the CPUs are busy before the benchmark "
            "starts; other processes will add noise to every figure",
            file=sys.stderr,
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    folder = Path(args.model) if args.model else prepare_bundled_model(envs.cache_dir() / "models")
    print(
        f"concurrency {args.concurrency}, {args.prompt_len} prompt + {args.max_tokens} output "
        f"tokens per request, {args.rounds} rounds, {args.threads} torch thread(s) per engine"
    )
    started = datetime.now(UTC)
    outcome = asyncio.run(run(args, folder))
    rounds: list[RoundResult] = outcome["rounds"]
    summary = summarize(rounds, args.concurrency)
    goal_results = goals(summary)

    rows = [
        [
            "mode",
            "C",
            "TTFT min",
            "TTFT p50",
            "TTFT p90",
            "TPOT p50",
            "TPOT p90",
            "tok/s",
            "CPU ms/tok",
            "others' CPU",
        ]
    ]
    for c in args.concurrency:
        for mode in MODES:
            s = summary[str(c)]["modes"][mode]
            cpu = " ".join(f"{k} {v:.2f}" for k, v in s["cpu_ms_per_token"].items())
            other = s["other_processes_cpu_share"]
            rows.append(
                [
                    MODE_NAMES[mode],
                    str(c),
                    f"{s['ttft_min_ms']:.1f}",
                    f"{s['ttft_p50_ms']:.1f}",
                    f"{s['ttft_p90_ms']:.1f}",
                    f"{s['tpot_p50_ms']:.2f}",
                    f"{s['tpot_p90_ms']:.2f}",
                    f"{s['output_tokens_per_s']:.1f}",
                    cpu,
                    "-" if other is None else f"{100 * other:.0f}%",
                ]
            )
    print()
    print("times in ms; medians over rounds of each round's min/p50/p90")
    print(format_table(rows))
    print()
    added_rows = [["added (ms, ± noise)", "C", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"]]
    for c in args.concurrency:
        for name, label in (
            ("client_minus_core", "engine process - core"),
            ("http_minus_client", "HTTP - engine process"),
            ("http_minus_core", "gateway total (HTTP - core)"),
        ):
            a = summary[str(c)]["added"][name]
            added_rows.append(
                [label, str(c)] + [f"{a[m]:+.2f} ± {fmt_noise(a[m + '_noise'])}" for m in LATENCIES]
            )
    print(format_table(added_rows))
    print("(noise: half the range of the round-by-round differences)")
    others = [r.other_cpu_share for r in rounds if r.other_cpu_share is not None]
    busy_during = statistics.mean(others) if others else None
    if busy_during is not None and busy_during > BUSY_WARNING:
        print(
            f"warning: other processes kept {100 * busy_during:.0f}% of the CPUs busy during "
            "the rounds; the engine's step time moved with them, so differences of a few ms "
            "are not resolved here (see the noise)",
            file=sys.stderr,
        )
    print()
    print("paired (the client's mean minus what the server recorded for the same requests):")
    for c in args.concurrency:
        for key, what, where in (
            ("gateway_ttft", "TTFT", "the engine's own"),
            ("process_ttft", "TTFT through the engine client", "the engine's own"),
            ("http_layer_ttft", "TTFT", "the gateway's own"),
            ("http_layer_tpot", "TPOT", "the gateway's own"),
        ):
            p = summary[str(c)][key]
            if p:
                print(
                    f"  C={c}: {what} at the client {p['client_mean_ms']:.2f} ms, "
                    f"{where} {p['recorded_mean_ms']:.2f} ms: "
                    f"{p['added_ms']:+.2f} ± {fmt_noise(p['noise_ms'])} ms"
                )
        p = summary[str(c)]["engine_process_vs_core_ttft"]
        if p:
            print(
                f"  C={c} (not paired): the engine's own TTFT beside the gateway "
                f"{p['client_mean_ms']:.2f} ms, the in-process core's "
                f"{p['recorded_mean_ms']:.2f} ms: {p['added_ms']:+.2f} ± "
                f"{fmt_noise(p['noise_ms'])} ms"
            )
    for name, g in goal_results.items():
        print(
            f"goal {name}: {g['value_ms']:+.2f} ± {fmt_noise(g['noise_ms'])} ms "
            f"(goal < {g['goal_ms']} ms) -> {g['verdict']}"
        )
    for c in args.concurrency:
        held = summary[str(c)]["modes"]["http"]["tokens_without_own_event"]
        if held:
            print(f"note: at C={c}, {held} tokens had no SSE event of their own (held text)")

    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": started.isoformat(timespec="seconds"),
        "machine": {
            **machine_info(args.threads),
            "cpu_busy_before": busy_before,
            "load_average_after": os.getloadavg(),
            "other_processes_cpu_share_during_rounds": busy_during,
        },
        "args": args_json(args),
        "engine": {
            "model": str(folder),
            "num_threads": args.threads,
            "kv_cache_memory": args.kv_cache_memory,
            "prefix_caching": False,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_num_seqs": outcome["config"].scheduler.max_num_seqs,
            "serve_args": outcome["serve_args"],
        },
        "workload": {
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "waves_per_round": {str(c): waves_per_round(c, args) for c in args.concurrency},
        },
        "load_s": outcome["load_s"],
        "renice": outcome["renice"],
        "burst_writer": outcome["burst_writer"],
        "summary": summary,
        "goals": goal_results,
        "rounds": [round_to_json(r) for r in rounds],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{RESULT_NAME}.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png_path = args.out / f"{RESULT_NAME}.png"
    plot(png_path, rounds, summary)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
