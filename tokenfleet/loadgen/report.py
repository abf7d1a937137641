"""Statistics of a bench run and their three renderings: the table, bench.json, bench.png.

Per class: counts by status; TTFT and TPOT p50/p90/p99 over ok requests (TPOT per request:
(last token - first token) / (output tokens - 1)); output tokens per second over the
class's span (first request sent to last one done); for the interactive class, goodput:
the requests that met both targets (TTFT <= target and TPOT <= target) among all sent.
The timeline counts output tokens per class in fixed bins, as tokens per second.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenfleet.loadgen.client import RequestRecord

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)
KINDS = ("interactive", "batch")

# (start, end, output tokens): a token event (start == end) or tokens known only to have
# come within an interval (a batch between two polls)
TokenEvent = tuple[float, float, float]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, interpolated linearly between closest ranks (numpy's default);
    None without values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class ClassSummary:
    kind: str
    num_requests: int
    num_ok: int
    num_refused: int
    num_errored: int
    num_unfinished: int
    ttft_s: dict[str, float | None]  # "p50", "p90", "p99"
    tpot_s: dict[str, float | None]
    output_tokens: int  # of ok requests
    span_s: float | None  # first sent to last done
    output_tokens_per_s: float | None
    num_good: int | None  # interactive only: ok and both targets met
    goodput: float | None  # num_good / num_requests


def meets_targets(record: RequestRecord, targets: Targets) -> bool:
    ttft, tpot = record.ttft_s, record.tpot_s
    return ttft is not None and ttft <= targets.ttft_s and (tpot is None or tpot <= targets.tpot_s)


def summarize(records: Sequence[RequestRecord], kind: str, targets: Targets) -> ClassSummary:
    mine = [r for r in records if r.kind == kind]
    ok = [r for r in mine if r.status == "ok"]

    def count(status: str) -> int:
        return sum(r.status == status for r in mine)

    def percentiles(values: list[float]) -> dict[str, float | None]:
        return {f"p{q}": percentile(values, q) for q in PERCENTILES}

    sent = [r.sent_s for r in mine if r.sent_s is not None]
    done = [r.done_s for r in mine if r.done_s is not None]
    span = max(done) - min(sent) if sent and done else None
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    num_good = sum(meets_targets(r, targets) for r in mine) if kind == "interactive" else None
    return ClassSummary(
        kind=kind,
        num_requests=len(mine),
        num_ok=len(ok),
        num_refused=count("refused"),
        num_errored=count("errored"),
        num_unfinished=count("unfinished"),
        ttft_s=percentiles([t for r in ok if (t := r.ttft_s) is not None]),
        tpot_s=percentiles([t for r in ok if (t := r.tpot_s) is not None]),
        output_tokens=output_tokens,
        span_s=span,
        output_tokens_per_s=output_tokens / span if span else None,
        num_good=num_good,
        goodput=num_good / len(mine) if num_good is not None and mine else None,
    )


def token_events(record: RequestRecord) -> list[TokenEvent]:
    """One event per content event, each carrying its share of the output tokens (a
    server may put several tokens in one event)."""
    times = record.token_times_s
    if not times:
        return []
    each = record.output_tokens / len(times) if record.output_tokens else 1.0
    return [(t, t, each) for t in times]


def timeline(events: Iterable[TokenEvent], num_bins: int, bin_s: float = 1.0) -> list[float]:
    """Tokens per second in each of `num_bins` bins of `bin_s` from time 0; an interval's
    tokens are spread evenly over it, an event past the end falls in the last bin."""
    tokens = [0.0] * num_bins
    last = num_bins - 1
    for start, end, amount in events:
        if end <= start:
            tokens[min(int(start // bin_s), last)] += amount
            continue
        for i in range(min(int(start // bin_s), last), min(int(end // bin_s), last) + 1):
            low, high = max(start, i * bin_s), min(end, (i + 1) * bin_s)
            if i == last:
                high = end
            tokens[i] += amount * max(high - low, 0.0) / (end - start)
    return [t / bin_s for t in tokens]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_table(summaries: Sequence[ClassSummary], targets: Targets) -> str:
    head = (
        f"{'class':<12}{'reqs':>6}{'ok':>6}{'refused':>8}{'errored':>8}{'unfin':>6}"
        f"{'TTFT ms p50/p90/p99':>22}{'TPOT ms p50/p90/p99':>22}{'out tok/s':>11}"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        if not s.num_requests:
            continue
        ttft = "/".join(_ms(s.ttft_s[f"p{q}"]) for q in PERCENTILES)
        tpot = "/".join(_ms(s.tpot_s[f"p{q}"]) for q in PERCENTILES)
        rate = "-" if s.output_tokens_per_s is None else f"{s.output_tokens_per_s:.1f}"
        lines.append(
            f"{s.kind:<12}{s.num_requests:>6}{s.num_ok:>6}{s.num_refused:>8}{s.num_errored:>8}"
            f"{s.num_unfinished:>6}{ttft:>22}{tpot:>22}{rate:>11}"
        )
    for s in summaries:
        if s.goodput is not None:
            lines.append(
                f"goodput: {s.num_good}/{s.num_requests} {s.kind} requests ({s.goodput:.1%}) "
                f"with TTFT <= {targets.ttft_s * 1000:.0f} ms and TPOT <= "
                f"{targets.tpot_s * 1000:.0f} ms"
            )
    return "\n".join(lines)


def summary_dict(summary: ClassSummary) -> dict[str, Any]:
    return asdict(summary)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def plot(
    path: Path, records: Sequence[RequestRecord], timelines: dict[str, list[float]], bin_s: float
) -> bool:
    """bench.png: TTFT and TPOT CDFs per class, tokens/s by class over time. False (and a
    warning) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no %s (pip install matplotlib)", path.name)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, name in zip(axes[:2], ("ttft_s", "tpot_s"), strict=True):
        for kind in KINDS:
            values = sorted(
                v for r in records if r.kind == kind and (v := getattr(r, name)) is not None
            )
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step([v * 1000 for v in values], ys, where="post", label=kind)
        ax.set_xlabel(f"{name[:4].upper()} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{name[:4].upper()} CDF")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    ax = axes[2]
    for kind, series in timelines.items():
        if any(series):
            ax.stairs(series, [i * bin_s for i in range(len(series) + 1)], label=kind)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"output tokens/s by class ({bin_s:g} s bins)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
