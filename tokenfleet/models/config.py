"""A Llama-family model's shape, read from a Hugging Face `config.json`. No torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfleet.errors import ModelLoadError

# architecture -> whether q/k/v projections carry a bias by construction
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def num_params(self) -> int:
        """Parameters touched per token (the embedding lookup is free, the LM head is not)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads
        attn = h * q + 2 * h * kv * self.head_dim + q * h
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * h

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"model folder {folder} has no config.json")
        raw = json.loads(path.read_text())
        generation = folder / "generation_config.json"
        gen = json.loads(generation.read_text()) if generation.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs}: tokenfleet serves "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers 5 writes rope settings as `rope_parameters`; older ones as
        # `rope_theta` plus `rope_scaling`.
        rope: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope_type {rope_type!r}: tokenfleet supports {SUPPORTED_ROPE_TYPES}"
            )
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        bias_by_arch = SUPPORTED_ARCHITECTURES[arch]
        attention_bias = bool(raw.get("attention_bias", False))
        window = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            window = None
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bias_by_arch or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
