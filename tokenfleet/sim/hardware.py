"""What the simulator runs on: an accelerator's datasheet numbers and a model's shape.

Only what a roofline needs: memory bandwidth and dense bf16 FLOP/s (with efficiencies, the
share of the datasheet a well-tuned kernel reaches), memory size, the link between
tensor-parallel ranks; the model's layer counts and widths. From them come the weights'
bytes, the FLOPs per token, the KV bytes per token and how many tokens of KV fit in what
memory the weights leave.

    memory per accelerator:  [ weights / tp | activations | KV cache ....... | unused ]
                             0              utilization * memory_bytes ------^
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    """Datasheet numbers of one accelerator, and the share of them kernels reach."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense, no sparsity
    link_bytes_per_s: float = 450e9  # NVLink, one direction, per accelerator
    memory_efficiency: float = 0.8
    compute_efficiency: float = 0.6
    link_efficiency: float = 0.7
    all_reduce_latency_s: float = 10e-6
    step_overhead_s: float = 1e-3  # launch, sampling and scheduling per step
    memory_utilization: float = 0.9  # share of memory_bytes the engine may take
    activation_bytes: float = 2 * 2**30  # kept free for activations and the runtime

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "hbm_bytes_per_s", "bf16_flops", "link_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "memory_efficiency",
            "compute_efficiency",
            "link_efficiency",
            "memory_utilization",
        ):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.step_overhead_s < 0 or self.all_reduce_latency_s < 0:
            raise ValueError("step_overhead_s and all_reduce_latency_s must be >= 0")


ACCELERATORS = {
    "H100": Accelerator("H100", memory_bytes=80e9, hbm_bytes_per_s=3.35e12, bf16_flops=989e12),
    "H200": Accelerator("H200", memory_bytes=141e9, hbm_bytes_per_s=4.8e12, bf16_flops=989e12),
}


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder: grouped-query attention, a gated MLP, untied embeddings."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    bytes_per_param: int = 2  # bf16
    kv_bytes_per_value: int = 2

    @property
    def layer_params(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies through: the layers and the LM head (the
        embedding table is a lookup)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        return self.matmul_params + self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query token, context token) pair over all layers: QK and PV."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


MODELS = {
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
}


@dataclass(frozen=True)
class Deployment:
    """One replica: a model over `tensor_parallel` accelerators of one kind."""

    accelerator: Accelerator
    model: ModelShape
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.kv_cache_tokens() < 1:
            raise ValueError(
                f"{self.model.name} does not fit {self.tensor_parallel} x "
                f"{self.accelerator.name}: no memory is left for the KV cache"
            )

    def kv_cache_tokens(self) -> int:
        """Tokens of KV the replica holds in the memory its weights leave.

        Each rank keeps its share of the KV heads (all of a head's values, none of the
        others'), so the replica's capacity is the ranks' free memory over the whole
        token's KV bytes.
        """
        acc = self.accelerator
        tp = self.tensor_parallel
        free_per_rank = (
            acc.memory_bytes * acc.memory_utilization
            - self.model.weight_bytes / tp
            - acc.activation_bytes
        )
        return max(0, int(free_per_rank * tp // self.model.kv_bytes_per_token))

    def num_kv_blocks(self, block_size: int) -> int:
        return self.kv_cache_tokens() // block_size


def deployment(accelerator: str, model: str, tensor_parallel: int = 1) -> Deployment:
    """A deployment from preset names (ACCELERATORS, MODELS); ValueError naming them."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {sorted(ACCELERATORS)}, got {accelerator!r}")
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    return Deployment(ACCELERATORS[accelerator], MODELS[model], tensor_parallel)
