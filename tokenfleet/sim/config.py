"""A simulation's settings, read from YAML into frozen dataclasses (examples/sim/*.yaml).

    seed: 0
    duration_s: 3600
    accelerator: H200            # or {name: H200, memory_efficiency: 0.75, ...}
    model: llama-3-8b
    tensor_parallel: 1
    cost: roofline               # or {coefficients: fitted.json} (StepTimeModel terms)
    replica: {max_num_batched_tokens: 2048, max_num_seqs: 256, leap: true, ...}
    targets: {ttft_p50_s: 0.5, ttft_p99_s: 2.0, tpot_p50_s: 0.04, tpot_p99_s: 0.06}
    interactive: {peak_rate: 20, start_hour: 9, lengths: {...}, prompts: {...}}
    trace: arrivals.jsonl        # replayed instead of interactive + batch_jobs
    batch_jobs: [{submit_s: 0, num_requests: 100000, deadline_s: 86400}]
    policies: [{name: separate, replicas: 8, interactive_replicas: 4}, {name: priority,
               replicas: 8}]
    autoscaler: {min_replicas: 2, max_replicas: 64}   # every pool, when present
    sample_replicas: 8           # simulate each policy's N replicas as 8 given 8/N of the
                                 # traffic, totals scaled back to N (sampling.py)

A compressed day: `interactive: {hour_s: 150}` runs each hour of the daily curve in 150
simulated seconds (24x faster than a real day). The batch jobs' submit_s and deadline_s
are then read on the real day's clock and compressed with it (deadline_s: 86400 is due
at the end of the compressed day); duration_s, sample_s and the autoscaler's times stay
simulated seconds, and every request still takes its real time.

An unknown key is an error naming it (ConfigError), never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from tokenfleet.config import SchedulerConfig
from tokenfleet.fleet.autoscaler import AutoscalerConfig
from tokenfleet.fleet.router import RouterConfig
from tokenfleet.sim.hardware import ACCELERATORS, Deployment, deployment
from tokenfleet.sim.metrics import Targets
from tokenfleet.sim.pool import FleetPolicy, fleet_policy
from tokenfleet.sim.replica import ReplicaConfig
from tokenfleet.sim.sampling import Sampling
from tokenfleet.sim.workload import BatchJob, InteractiveWorkload, Lengths, SharedPrompts

T = TypeVar("T")
_SCHEDULER_KEYS = {f.name for f in fields(SchedulerConfig)}


class ConfigError(ValueError):
    """A setting that is missing, unknown or out of range; the message names it."""


@dataclass(frozen=True)
class SimConfig:
    deployment: Deployment
    policies: tuple[FleetPolicy, ...]
    replica: ReplicaConfig
    duration_s: float = 3600.0
    seed: int = 0
    coefficients: Path | None = None  # a fitted step-time model instead of the roofline
    targets: Targets = field(default_factory=Targets)
    router: RouterConfig = field(default_factory=RouterConfig)
    interactive: InteractiveWorkload = field(default_factory=InteractiveWorkload)
    batch_jobs: tuple[BatchJob, ...] = ()
    trace: Path | None = None
    sample_s: float = 60.0
    sample_replicas: int | None = None  # k: each policy run as k of its replicas

    def sampling(self, policy: FleetPolicy) -> Sampling | None:
        """The policy's sample (k of its N replicas), None when run in full."""
        if self.sample_replicas is None:
            return None
        return Sampling(self.sample_replicas, sum(p.replicas for p in policy.pools))


def sampled(config: SimConfig, num_simulated: int | None) -> SimConfig:
    """The config with `sample_replicas` set (None: in full), checked against every
    policy: 1 <= k <= N, and every pool's replicas scaling to a whole number."""
    config = replace(config, sample_replicas=num_simulated)
    for policy in config.policies:
        try:
            sampling = config.sampling(policy)
            if sampling is not None:
                sampling.policy(policy)
        except ValueError as exc:
            raise ConfigError(f"sample_replicas: policy {policy.name!r}: {exc}") from exc
    return config


def _make(cls: type[T], values: Any, where: str) -> T:
    """cls(**values), with unknown keys and bad values reported as ConfigError."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping, got {values!r}")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _lengths_and_prompts(values: dict[str, Any], where: str) -> dict[str, Any]:
    values = dict(values)
    if "lengths" in values:
        values["lengths"] = _make(Lengths, values["lengths"], f"{where}.lengths")
    if "prompts" in values:
        values["prompts"] = _make(SharedPrompts, values["prompts"], f"{where}.prompts")
    if "daily_curve" in values:
        values["daily_curve"] = tuple(values["daily_curve"])
    return values


def _deployment(data: dict[str, Any]) -> Deployment:
    accelerator = data.get("accelerator", "H200")
    overrides: dict[str, Any] = {}
    if isinstance(accelerator, dict):
        overrides = dict(accelerator)
        accelerator = overrides.pop("name", "H200")
    try:
        base = deployment(
            accelerator, data.get("model", "llama-3-8b"), data.get("tensor_parallel", 1)
        )
        if overrides:
            acc = _make(
                type(ACCELERATORS[accelerator]),
                {**_fields_of(base.accelerator), **overrides},
                "accelerator",
            )
            base = replace(base, accelerator=acc)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return base


def _fields_of(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _replica(data: dict[str, Any], dep: Deployment) -> ReplicaConfig:
    values = dict(data.get("replica") or {})
    scheduler = {k: values.pop(k) for k in list(values) if k in _SCHEDULER_KEYS}
    scheduler.setdefault("max_num_batched_tokens", 2048)
    scheduler.setdefault("max_num_seqs", 256)
    scheduler.setdefault("max_model_len", 16384 + 1024)
    values["scheduler"] = _make(SchedulerConfig, scheduler, "replica")
    values.setdefault("num_kv_blocks", dep.num_kv_blocks(values.get("block_size", 16)))
    return _make(ReplicaConfig, values, "replica")


def parse_config(data: dict[str, Any], base: Path = Path()) -> SimConfig:
    """A SimConfig from the YAML's mapping; relative paths are taken from `base`."""
    known = {f.name for f in fields(SimConfig)} | {"accelerator", "model", "tensor_parallel"}
    known |= {"cost", "autoscaler"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    dep = _deployment(data)
    autoscaler = data.get("autoscaler")
    scaling = None if autoscaler is None else _make(AutoscalerConfig, autoscaler, "autoscaler")
    policies = []
    for i, spec in enumerate(data.get("policies") or [{"name": "priority", "replicas": 4}]):
        spec = dict(spec)
        try:
            policies.append(fleet_policy(spec.pop("name"), autoscaler=scaling, **spec))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"policies[{i}]: {exc!r}") from exc
    cost = data.get("cost", "roofline")
    coefficients = None
    if isinstance(cost, dict) and set(cost) == {"coefficients"}:
        coefficients = base / cost["coefficients"]
    elif cost != "roofline":
        raise ConfigError("cost must be 'roofline' or {coefficients: PATH}")
    interactive = _make(
        InteractiveWorkload,
        _lengths_and_prompts(data.get("interactive") or {}, "interactive"),
        "interactive",
    )
    jobs = tuple(
        _make(
            BatchJob, _lengths_and_prompts(job, f"batch_jobs[{i}]"), f"batch_jobs[{i}]"
        ).on_clock_of(interactive)
        for i, job in enumerate(data.get("batch_jobs") or [])
    )
    trace = data.get("trace")
    num_simulated = data.get("sample_replicas")
    if num_simulated is not None and (
        isinstance(num_simulated, bool) or not isinstance(num_simulated, int)
    ):
        raise ConfigError(f"sample_replicas must be a whole number, got {num_simulated!r}")
    config = SimConfig(
        deployment=dep,
        policies=tuple(policies),
        replica=_replica(data, dep),
        duration_s=float(data.get("duration_s", 3600.0)),
        seed=int(data.get("seed", 0)),
        coefficients=coefficients,
        targets=_make(Targets, data.get("targets"), "targets"),
        router=_make(RouterConfig, data.get("router"), "router"),
        interactive=interactive,
        batch_jobs=jobs,
        trace=None if trace is None else base / trace,
        sample_s=float(data.get("sample_s", 60.0)),
    )
    return sampled(config, num_simulated)


def load_config(path: Path) -> SimConfig:
    import yaml

    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping")
    return parse_config(data, path.parent)
