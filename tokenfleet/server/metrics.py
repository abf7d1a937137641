"""Prometheus metrics: latency histograms recorded by the gateway, engine gauges read from
the engine's last step message at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from tokenfleet.core.engine_api import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.4, 1, 2, 5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], SchedulerStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily]:
        stats = self._stats()
        if stats is None:
            return
        gauges = {
            "tokenfleet_num_requests_running": (
                "requests running in the engine",
                stats.num_running,
            ),
            "tokenfleet_num_requests_waiting": (
                "requests waiting in the engine",
                stats.num_waiting,
            ),
            "tokenfleet_kv_blocks_used": ("KV-cache blocks in use", stats.num_kv_blocks_used),
            "tokenfleet_kv_blocks_total": ("KV-cache blocks in all", stats.num_kv_blocks_total),
            "tokenfleet_prefix_cache_hit_rate": (
                "prompt tokens served from the prefix cache, over prompt tokens looked up",
                stats.num_prefix_hit_tokens / max(stats.num_prefix_query_tokens, 1),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "tokenfleet_preemptions",
            "requests preempted since the engine started",
            value=stats.num_preemptions,
        )
        yield CounterMetricFamily(
            "tokenfleet_prefix_cache_hit_tokens",
            "prompt tokens served from the prefix cache since the engine started",
            value=stats.num_prefix_hit_tokens,
        )
        yield from _step_model_gauges(stats)
        yield from _class_metrics(stats)


def _class_metrics(
    stats: SchedulerStats,
) -> Iterator[GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily]:
    """Interactive and batch side by side: requests, preemptions, the reserve, the harvest
    budget (harvest.py)."""
    for name, doc, values in (
        ("running", "requests running in the engine, by class", stats.num_running_by_class),
        ("waiting", "requests waiting in the engine, by class", stats.num_waiting_by_class),
    ):
        gauge = GaugeMetricFamily(
            f"tokenfleet_num_requests_{name}_by_class", doc, labels=("class",)
        )
        for label, value in values.items():
            gauge.add_metric((label,), value)
        yield gauge
    preemptions = CounterMetricFamily(
        "tokenfleet_preemptions_by_class",
        "requests preempted since the engine started, by the preempted request's class",
        labels=("class",),
    )
    for label, value in stats.num_preemptions_by_class.items():
        preemptions.add_metric((label,), value)
    yield preemptions
    engine_ttft = SummaryMetricFamily(
        "tokenfleet_engine_time_to_first_token_seconds",
        "the engine's own time to first token, from the start of the first step after it "
        "took a request to the end of the step that gave its first token, by class (what the "
        "gateway adds is the rest)",
        labels=("class",),
    )
    for label, count in stats.ttft_count_by_class.items():
        engine_ttft.add_metric((label,), count, stats.ttft_sum_s_by_class.get(label, 0.0))
    yield engine_ttft
    yield GaugeMetricFamily(
        "tokenfleet_kv_blocks_reserved_interactive",
        "free KV-cache blocks batch work had to leave for interactive arrivals in the last step",
        value=stats.num_kv_blocks_reserved_interactive,
    )
    if stats.batch_token_budget is not None:
        yield GaugeMetricFamily(
            "tokenfleet_batch_token_budget",
            "batch tokens allowed in the last step with batch work (the harvest budget)",
            value=stats.batch_token_budget,
        )


def _step_model_gauges(stats: SchedulerStats) -> Iterator[GaugeMetricFamily]:
    """The step-time model (step_model.py): how far off its recent predictions were, and
    its coefficients."""
    error = GaugeMetricFamily(
        "tokenfleet_step_time_prediction_error_ratio",
        "relative error |predicted - measured| / measured of recent steps' predicted runner "
        "time, by quantile",
        labels=("quantile",),
    )
    for quantile, value in (
        ("0.5", stats.step_time_error_p50),
        ("0.99", stats.step_time_error_p99),
    ):
        if value is not None:
            error.add_metric((quantile,), value)
    yield error
    coefficients = GaugeMetricFamily(
        "tokenfleet_step_time_model_coefficient",
        "step-time model coefficient: seconds per step (intercept) or per unit of the term",
        labels=("term",),
    )
    for term, value in stats.step_time_coefficients.items():
        coefficients.add_metric((term,), value)
    yield coefficients


class Drains(Protocol):
    """The fleet's drains so far (cluster/scaling.py's Scaler)."""

    @property
    def num_drained(self) -> int: ...

    @property
    def drain_seconds_sum(self) -> float: ...

    @property
    def num_drain_moves(self) -> int: ...

    @property
    def drains(self) -> Sized:
        """Those in progress."""
        ...


class Health(Protocol):
    """The fleet's slow and fenced replicas (cluster/health.py's FleetHealth)."""

    @property
    def num_slow(self) -> int: ...

    @property
    def num_fenced(self) -> int: ...

    @property
    def num_dropped(self) -> int: ...


class _ReplicaCollector(Collector):
    """Per-replica series, labelled `replica` (its id), from each one's latest message."""

    def __init__(
        self,
        replicas: Callable[[], dict[str, SchedulerStats]],
        moves: Callable[[], int],
        drains: Drains | None,
        health: Health | None = None,
    ) -> None:
        self._replicas = replicas
        self._moves = moves
        self._drains = drains
        self._health = health

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily]:
        series: dict[str, tuple[str, Callable[[SchedulerStats], float]]] = {
            "tokenfleet_replica_requests_running": (
                "requests running on the replica",
                lambda s: s.num_running,
            ),
            "tokenfleet_replica_requests_waiting": (
                "requests waiting on the replica",
                lambda s: s.num_waiting,
            ),
            "tokenfleet_replica_kv_blocks_used": (
                "KV-cache blocks in use on the replica",
                lambda s: s.num_kv_blocks_used,
            ),
            "tokenfleet_replica_kv_blocks_total": (
                "KV-cache blocks of the replica",
                lambda s: s.num_kv_blocks_total,
            ),
        }
        replicas = self._replicas()
        for name, (doc, value) in series.items():
            family = GaugeMetricFamily(name, doc, labels=("replica",))
            for replica, stats in sorted(replicas.items()):
                family.add_metric((replica,), value(stats))
            yield family
        hits = CounterMetricFamily(
            "tokenfleet_replica_prefix_cache_hit_tokens",
            "prompt tokens served from the replica's prefix cache since it started",
            labels=("replica",),
        )
        for replica, stats in sorted(replicas.items()):
            hits.add_metric((replica,), stats.num_prefix_hit_tokens)
        yield hits
        yield CounterMetricFamily(
            "tokenfleet_fleet_request_moves",
            "requests moved to another replica after theirs died, since the gateway started",
            value=self._moves(),
        )
        drains = self._drains
        if drains is not None:
            yield SummaryMetricFamily(
                "tokenfleet_fleet_drain_seconds",
                "drains ended with the replica gone: seconds from the drain to gone",
                count_value=drains.num_drained,
                sum_value=drains.drain_seconds_sum,
            )
            yield CounterMetricFamily(
                "tokenfleet_fleet_drain_moves",
                "requests moved off a draining replica once its grace was over",
                value=drains.num_drain_moves,
            )
            yield GaugeMetricFamily(
                "tokenfleet_fleet_replicas_draining",
                "replicas draining now",
                value=len(drains.drains),
            )
        health = self._health
        if health is not None:
            yield GaugeMetricFamily(
                "tokenfleet_fleet_replicas_slow",
                "replicas slow now (no new work: their steps above the others' median)",
                value=health.num_slow,
            )
            yield CounterMetricFamily(
                "tokenfleet_fleet_replicas_fenced",
                "replicas fenced after a silence (and replaced) since the gateway started",
                value=health.num_fenced,
            )
            yield CounterMetricFamily(
                "tokenfleet_fleet_dropped_messages",
                "messages of a fenced incarnation and outputs of a moved request's older "
                "attempt, dropped since the gateway started",
                value=health.num_dropped,
            )


class Metrics:
    def __init__(
        self,
        engine_stats: Callable[[], SchedulerStats | None],
        replica_stats: Callable[[], dict[str, SchedulerStats]] | None = None,
        moves: Callable[[], int] = lambda: 0,
        drains: Drains | None = None,
        health: Health | None = None,
    ) -> None:
        """`engine_stats`: all replicas' as one (the single engine's); `replica_stats`:
        each replica's, for series with a `replica` label; `drains`, `health`: a fleet's."""
        self.registry = CollectorRegistry()
        if replica_stats is not None:
            self.registry.register(_ReplicaCollector(replica_stats, moves, drains, health))
        labels = ("route", "priority")
        self.ttft = Histogram(
            "tokenfleet_time_to_first_token_seconds",
            "time to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "tokenfleet_time_per_output_token_seconds",
            "time per output token after the first",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tokenfleet_e2e_request_latency_seconds",
            "request latency, end to end",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tokenfleet_prompt_tokens", "prompt tokens accepted", registry=self.registry
        )
        self.generation_tokens = Counter(
            "tokenfleet_generation_tokens", "tokens generated", registry=self.registry
        )
        self.batch_results = Counter(
            "tokenfleet_batch_results",
            "batch request outcomes this gateway committed (succeeded, errored, canceled) or "
            "gave back after an engine failure (released)",
            ("outcome",),
            registry=self.registry,
        )
        # The gateway's own defences: requests refused by their group's limits, streams
        # aborted for a reader that fell behind, large bodies being checked off the loop.
        self.rate_limited = Counter(
            "tokenfleet_rate_limited",
            "interactive requests refused (429) by their key group's limits, by limit "
            "(requests: concurrency or requests per minute; tokens: tokens per minute)",
            ("limit",),
            registry=self.registry,
        )
        self.streams_stalled = Counter(
            "tokenfleet_streams_stalled",
            "streams aborted because their reader fell behind (the send buffer stayed full "
            "past --stream-stall-timeout)",
            registry=self.registry,
        )
        self.prechecks_running = Gauge(
            "tokenfleet_body_checks_running",
            "large bodies being checked and tokenized in the thread pool now",
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine_stats))
        self._series: dict[tuple[str, str], tuple[Histogram, Histogram, Histogram]] = {}

    def latency_series(self, route: str, priority: str) -> tuple[Histogram, Histogram, Histogram]:
        """The TTFT, TPOT and end-to-end histograms of a route and class, looked up once
        (prometheus_client's labels() takes a lock and builds a key at every call)."""
        series = self._series.get((route, priority))
        if series is None:
            series = (
                self.ttft.labels(route, priority),
                self.tpot.labels(route, priority),
                self.e2e.labels(route, priority),
            )
            self._series[(route, priority)] = series
        return series
