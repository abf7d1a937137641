"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flattened token batch.

Every step's tokens, from all requests, prefill chunks and decodes alike, go through the
linear layers as one [num_tokens, hidden] matrix; only attention looks at sequences.
q/k/v and gate/up are fused into one matmul each; the loader fills their slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfleet import kernels
from tokenfleet.models import packed
from tokenfleet.models.attention import AttentionMetadata, PagedAttention
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x + residual (x alone where residual is None) and its norm: (normed, sum). With
        `fused`, one pass of the C kernel, the sum written over x."""
        if fused:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps), x
        if residual is not None:
            x = x + residual
        return self.forward(x), x


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, use_kernel: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, config.sliding_window, use_kernel
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        fused: bool = False,  # the C element-wise kernels (LlamaForCausalLM.use_fused)
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        n = x.shape[0]
        if fused:  # q's and k's heads, side by side in each row, rotated in place
            kernels.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if not fused:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, use_kernel: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, use_kernel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on (x, residual): the residual stream is residual + x (x alone in the
        first layer), and the sum is made where the norm reads it. Returns the MLP's output
        and the stream before it, for the next layer to add. `fused`: through the C
        element-wise kernels (LlamaForCausalLM.use_fused)."""
        h, residual = self.input_layernorm.add_forward(x, residual, fused)
        x = self.self_attn(h, cos, sin, kv_cache, meta, fused)
        h, residual = self.post_attention_layernorm.add_forward(x, residual, fused)
        return self.mlp(h), residual


# Rows of the vocabulary's weight a CPU float32 logits product takes at a time.
VOCAB_BLOCK = 1024


def vocab_blocks(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h @ weight.T, VOCAB_BLOCK rows of `weight` at a time (the same sums as one product)."""
    blocks = [
        F.linear(h, weight[i : i + VOCAB_BLOCK]) for i in range(0, weight.shape[0], VOCAB_BLOCK)
    ]
    return torch.cat(blocks, dim=1)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, use_kernel: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, use_kernel) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The CPU float32 products' ways, chosen by tune_products (by timing) at load.
        self._weight_t: torch.Tensor | None = None
        self._vocab_packed: torch.Tensor | None = None
        self.linear_backend = "torch"
        self.fused = False  # the layers' norms and rotary embedding in C (use_fused)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        cos: torch.Tensor,  # [T, D], already indexed by position
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_idx: torch.Tensor,  # rows whose next-token logits are wanted
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, self.fused)
        assert residual is not None
        # The last layer's sum is wanted only in the rows whose logits are.
        return self.vocab_logits(self.norm(residual[logits_idx] + x[logits_idx])).float()

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h @ lm_head.weight.T. On CPU in float32 the one [V, H] product through the BLAS
        is slow for a few rows (the vocabulary's weight, 113 MB for the bundled model, is
        read per step): oneDNN's packed copy where `tune_products` found it faster, else in
        blocks of VOCAB_BLOCK rows of the weight, 1.2-2x faster than the one product at
        2-64 rows (AMD EPYC, one thread: 2 rows 24.8 -> 16.1 ms, 8 rows 20.9 -> 15.9, 64
        rows 62.9 -> 49.7) with the same sums; one row through the transposed copy where
        that was faster still (11.3 -> 5.8 ms there)."""
        if h.device.type != "cpu" or h.dtype != torch.float32:
            return self.lm_head(h)
        if h.shape[0] == 1 and self._weight_t is not None:
            return h @ self._weight_t
        if self._vocab_packed is not None:
            return packed.packed_linear(h, self._vocab_packed, None)
        return vocab_blocks(h, self.lm_head.weight)

    def use_fused(self, wanted: bool = True) -> bool:
        """Run the layers' norms and rotary embeddings through the C element-wise kernels
        (kernels/elementwise.c) where they apply: CPU, float32, a compiler at hand."""
        weight = self.embed_tokens.weight
        fused = (
            wanted
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and self.config.head_dim <= 1024
            and kernels.elementwise_lib() is not None
        )
        self.fused = fused
        return fused

    def tune_products(self, linear_backend: str = "auto", repeats: int = 3) -> None:
        """Choose how the CPU float32 products run, timed here, once, since which way is
        faster depends on the CPU and its BLAS: the decoder's linear layers and the
        vocabulary through oneDNN's packed weights (`linear_backend` "auto": where
        packed.faster says so on a decoder layer's weight; "onednn": always; "torch":
        never); and a transposed copy of the vocabulary's weight for one-row products (a
        decode step of one stream) if that beats the way chosen for more rows. The packed
        vocabulary is a copy beside the embedding's weight (tied or not): one more
        [V, H] float32 tensor in memory."""
        self._weight_t = self._vocab_packed = None
        self.linear_backend = "torch"
        weight = self.lm_head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            if linear_backend == "onednn":
                raise ValueError("linear_backend 'onednn' needs float32 weights on the CPU")
            return
        if linear_backend == "onednn" and not packed.available():
            raise ValueError("linear_backend 'onednn': this PyTorch build has no oneDNN")
        if linear_backend == "onednn" or (
            linear_backend == "auto"
            and packed.available()
            and packed.faster(self.layers[0].mlp.gate_up_proj.weight, repeats)
        ):
            packed.pack_linears(self.layers)
            self._vocab_packed = packed.pack(weight)
            self.linear_backend = "onednn"
        weight_t = weight.detach().t().contiguous()
        h = torch.randn(1, weight.shape[1])
        with torch.inference_mode():
            chosen = packed.best_time(lambda: self.vocab_logits(h), repeats)
            transposed = packed.best_time(lambda: h @ weight_t, repeats)
        if transposed < chosen:
            self._weight_t = weight_t
