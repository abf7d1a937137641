"""Engine settings: frozen dataclasses, validated when built, never mutated after."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

_DTYPES = ("float32", "bfloat16", "float16")
_ATTENTION_BACKENDS = ("auto", "torch")
_LINEAR_BACKENDS = ("auto", "torch", "onednn")


KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")


def check_reserve_settings(
    *, window_s: float, margin: float, min_blocks: int, max_fraction: float, prefix: str = ""
) -> None:
    """Raise ValueError naming the first bad setting (`prefix` + its name)."""
    if window_s <= 0:
        raise ValueError(f"{prefix}window_s must be positive, got {window_s}")
    if margin < 0:
        raise ValueError(f"{prefix}margin must be at least 0, got {margin}")
    if min_blocks < 0:
        raise ValueError(f"{prefix}min_blocks must be at least 0, got {min_blocks}")
    if not 0 <= max_fraction < 1:
        raise ValueError(f"{prefix}max_fraction must be in [0, 1), got {max_fraction}")


@dataclass(frozen=True)
class CacheConfig:
    """How much memory the paged KV cache gets, and how it is cut into blocks.

    `kv_cache_memory` (bytes) wins when set; otherwise the cache takes
    `kv_cache_memory_fraction` of the device memory still free after the weights load.
    `kv_cache_dtype` "auto" stores K/V in the model's dtype; "float16" or "bfloat16" store
    them in 16 bits (rounded when written): twice the tokens in the same memory, and half
    the bytes to read per token of context, at a small cost in accuracy.
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.1
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """The per-step budget: at most this many tokens and this many sequences.

    The interactive reserve (see `reserve.py`): batch requests leave at least
    peak interactive blocks over the last `interactive_reserve_window_s` seconds times
    `interactive_reserve_margin` free, clamped to [`interactive_reserve_min_blocks`,
    `interactive_reserve_max_fraction` of the cache]. A max fraction of 0 turns it off.

    `long_prefill_token_threshold`: while interactive requests wait, a running interactive
    prompt takes at most this many tokens a step, so that a long prompt does not hold the
    short ones behind it for its whole prefill (head-of-line blocking); what the waiting
    ones leave goes back to it in the same step. 0 turns it off (under fcfs it is off).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 128
    interactive_reserve_window_s: float = 30.0
    interactive_reserve_margin: float = 1.2
    interactive_reserve_min_blocks: int = 0
    interactive_reserve_max_fraction: float = 0.2

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be at least 0, got "
                f"{self.long_prefill_token_threshold}"
            )
        check_reserve_settings(
            window_s=self.interactive_reserve_window_s,
            margin=self.interactive_reserve_margin,
            min_blocks=self.interactive_reserve_min_blocks,
            max_fraction=self.interactive_reserve_max_fraction,
            prefix="interactive_reserve_",
        )

    def under(self, scheduling_policy: str) -> SchedulerConfig:
        """This config as a replica under `scheduling_policy` runs it: plain fcfs, as vLLM
        by default, cuts no long prompt for short ones."""
        if scheduling_policy == "fcfs":
            return replace(self, long_prefill_token_threshold=0)
        return self


@dataclass(frozen=True)
class EngineConfig:
    """One replica: which model, on which device, and its cache and scheduler settings.

    `model` None means the bundled SmolLM2-135M-Instruct, converted on first use.
    `attention_backend` "auto" decodes with the fused C kernel on CPU float32 when a C
    compiler is there; "torch" always gathers blocks and calls SDPA. `linear_backend`
    "auto" runs the linear layers on CPU float32 through oneDNN's packed weights where a
    timing at load finds them faster than torch's BLAS (models/packed.py); "onednn" always,
    "torch" never.
    The harvest budget (harvest.py): while interactive streams run, batch tokens join a
    step only while its predicted time stays within `tpot_target_s` * (1 -
    `harvest_margin`); the default target is the reference GPU's. The same limit cuts
    interactive prompts into chunks while interactive streams decode (at least one token a
    step); where the streams' decodes alone are over the limit, a prompt still gets
    `min_prefill_chunk` tokens a step, or fewer (at least one) where that many would break
    the TPOT target itself (harvest.with_floor). With no interactive work in a step,
    batch fills it, within `batch_step_limit_s` where set: an interactive arrival waits for
    the step in progress (None: no limit, throughput first).
    A constrained request (SamplingParams.constraint) waits out of the scheduler while its
    constraint compiles; one not compiled within `grammar_compile_timeout_s` of its arrival
    ends with an error, the others going on.
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int | None = None
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    # "model" runs the model; "fixed" answers a fixed token without running it (plumbing
    # tests at a scale the real model cannot reach in CI), each step taking
    # `fixed_step_s` plus `fixed_prefill_s_per_token` per prefilled token (a sleep).
    runner: str = "model"
    fixed_step_s: float = 0.0
    fixed_prefill_s_per_token: float = 0.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tpot_target_s: float = 0.06
    harvest_margin: float = 0.1
    min_prefill_chunk: int = 16
    batch_step_limit_s: float | None = None
    # "priority": interactive before batch, batch inside the harvest budget. "fcfs": one
    # class in arrival order and no harvest budget (vLLM's default), for comparisons.
    scheduling_policy: str = "priority"
    grammar_compile_timeout_s: float = 5.0
    # Plan step n+1 while step n's forward runs (engine/forward.py); False: one after the
    # other (`--no-overlap`, for comparison); None: on, except for the model on a CPU
    # whose torch threads take every core this process may use (the planning would then
    # take a core from the forward: measured slower, docs/benchmarks.md).
    overlap: bool | None = None

    def __post_init__(self) -> None:
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError(
                f"grammar_compile_timeout_s must be positive, got {self.grammar_compile_timeout_s}"
            )
        if self.scheduling_policy not in ("priority", "fcfs"):
            raise ValueError(
                f"scheduling_policy must be 'priority' or 'fcfs', got {self.scheduling_policy!r}"
            )
        if self.tpot_target_s <= 0:
            raise ValueError(f"tpot_target_s must be positive, got {self.tpot_target_s}")
        if self.min_prefill_chunk < 1:
            raise ValueError(f"min_prefill_chunk must be at least 1, got {self.min_prefill_chunk}")
        if self.batch_step_limit_s is not None and self.batch_step_limit_s <= 0:
            raise ValueError(f"batch_step_limit_s must be positive, got {self.batch_step_limit_s}")
        if not 0 <= self.harvest_margin < 1:
            raise ValueError(f"harvest_margin must be in [0, 1), got {self.harvest_margin}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {_ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.linear_backend not in _LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {_LINEAR_BACKENDS}, got {self.linear_backend!r}"
            )
        if self.linear_backend == "onednn" and (self.device, self.dtype) != ("cpu", "float32"):
            raise ValueError("linear_backend 'onednn' runs float32 on the CPU only")
        if self.runner not in ("model", "fixed"):
            raise ValueError(f"runner must be 'model' or 'fixed', got {self.runner!r}")
        if min(self.fixed_step_s, self.fixed_prefill_s_per_token) < 0:
            raise ValueError("the fixed runner's step times must be at least 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


@dataclass(frozen=True)
class FleetConfig:
    """Replicas on Ray (cluster/): `replicas` engine replicas on a local Ray instance, or on
    the cluster at `ray_address` (started by an operator with `ray start`).

    A replica beats every `beat_interval_s` from a thread of its own; a gateway that hears
    nothing from it for `replica_timeout_s` takes it for dead and moves its requests; Ray
    restarts it up to `max_restarts` times. A request moved more than `max_moves` times
    ends with an error. A replica aborts the requests of a gateway silent for
    `gateway_timeout_s`. `threads_per_replica`: torch threads of each CPU replica (None:
    the node's cores shared among `replicas`). A replica scaled away drains: its requests
    have `drain_grace_s` to end on it before they move to other replicas.
    """

    replicas: int = 1
    ray_address: str | None = None
    max_restarts: int = 3
    replica_timeout_s: float = 1.5
    beat_interval_s: float = 0.2
    gateway_timeout_s: float = 5.0
    max_moves: int = 3
    move_wait_s: float = 30.0
    threads_per_replica: int | None = None
    # fleet/router.py's policy: "prefix" (affinity and load), "least_loaded", "round_robin".
    router: str = "prefix"
    drain_grace_s: float = 30.0
    # cluster/health.py: a replica silent for `fence_timeout_s` (at least the replica
    # timeout) is fenced and replaced; one whose steps average above `slow_replica_factor`
    # x the others' median gets no new work (None: off).
    fence_timeout_s: float = 10.0
    slow_replica_factor: float | None = 2.0
    # `--autoscale MIN:MAX` (cluster/autoscaling.py runs fleet/autoscaler.py's policy once
    # for the fleet): its window and cool-downs, the calm windows before a scale-down, and
    # how long batch work must have been fed before its rate is measured.
    autoscale: tuple[int, int] | None = None
    autoscale_window_s: float = 60.0
    autoscale_up_cooldown_s: float = 60.0
    autoscale_down_cooldown_s: float = 300.0
    autoscale_calm_windows: int = 5
    autoscale_batch_settle_s: float = 30.0

    def __post_init__(self) -> None:
        if self.autoscale is not None and not 1 <= self.autoscale[0] <= self.autoscale[1]:
            raise ValueError(f"autoscale wants 1 <= MIN <= MAX, got {self.autoscale}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.max_restarts < 0 or self.max_moves < 0:
            raise ValueError("max_restarts and max_moves must be at least 0")
        if not 0 < self.beat_interval_s < self.replica_timeout_s:
            raise ValueError("the beat interval must be positive and under the replica timeout")
        if self.gateway_timeout_s <= 0 or self.move_wait_s <= 0:
            raise ValueError("gateway_timeout_s and move_wait_s must be positive")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be at least 0, got {self.drain_grace_s}")
        if self.fence_timeout_s < self.replica_timeout_s:
            raise ValueError("the fence timeout must be at least the replica timeout")
        if self.slow_replica_factor is not None and self.slow_replica_factor <= 1:
            raise ValueError("the slow replica factor must be over 1 (or None: off)")
