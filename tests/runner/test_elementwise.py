"""The decoder layer's fused element-wise C kernels (kernels/elementwise.c) against the torch
expressions they replace: the rotary embedding bit for bit, the residual add bit for bit,
the RMS norm within a unit or two in the last place (its sum of squares is summed in
another order)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenfleet import kernels
from tokenfleet.models.attention import AttentionMetadata
from tokenfleet.models.loader import load_model
from tokenfleet.models.rope import apply_rope, rope_cos_sin


@pytest.fixture(autouse=True)
def _the_kernels_built() -> None:
    # The project ships these kernels: production falls back to torch when they do not
    # build, but the tests fail, so that a broken kernel (or a missing compiler) shows.
    if kernels.elementwise_lib() is None:
        pytest.fail("the element-wise C kernels did not build: is a C compiler installed?")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (50, 576), (512, 576), (7, 1000)])
def test_add_rms_norm_adds_in_place_and_normalizes_as_torch(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    expected_sum = x + residual
    out = kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(x, expected_sum)  # the sum is written over x
    torch.testing.assert_close(out, _rms_norm(expected_sum, weight, 1e-5), rtol=1e-6, atol=1e-6)
    alone = kernels.add_rms_norm(expected_sum.clone(), None, weight, 1e-5)
    assert torch.equal(alone, out)


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "head_dim"), [(1, 9, 3, 64), (37, 9, 3, 64), (5, 8, 2, 128)]
)
def test_rope_in_place_equals_apply_rope_bit_for_bit(
    rows: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    """q's and k's heads rotated in place in a qkv row, v's left alone."""
    gen = torch.Generator().manual_seed(head_dim + rows)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(rows, q_size + 2 * kv_size, generator=gen)
    cos = torch.randn(rows, head_dim, generator=gen)
    sin = torch.randn(rows, head_dim, generator=gen)
    q = apply_rope(qkv[:, :q_size].reshape(rows, heads, head_dim), cos, sin)
    k = apply_rope(qkv[:, q_size : q_size + kv_size].reshape(rows, kv_heads, head_dim), cos, sin)
    v = qkv[:, q_size + kv_size :].clone()
    kernels.rope_(qkv, cos, sin, heads + kv_heads, head_dim)
    assert torch.equal(qkv[:, :q_size].reshape(rows, heads, head_dim), q)
    assert torch.equal(qkv[:, q_size : q_size + kv_size].reshape(rows, kv_heads, head_dim), k)
    assert torch.equal(qkv[:, q_size + kv_size :], v)


def test_the_model_with_and_without_the_fused_kernels(model_folder: Path) -> None:
    """The bundled model's logits for a prompt, fused and not, agree to float32 rounding
    and pick the same greedy token in every row."""
    model = load_model(model_folder, torch.device("cpu"), torch.float32, use_kernel=False)
    assert model.use_fused(True)
    ids = torch.arange(100, 160)
    config = model.config
    cos, sin = rope_cos_sin(config, 64, torch.device("cpu"), torch.float32)
    block_size = 16
    blocks = list(range(4))
    caches = [
        torch.zeros(2, 4, block_size, config.num_kv_heads, config.head_dim)
        for _ in range(config.num_layers)
    ]
    meta = AttentionMetadata.build([(0, 60, blocks)], block_size, torch.device("cpu"), None)
    rows = torch.arange(60)
    with torch.no_grad():
        fused = model(ids, cos[:60], sin[:60], caches, meta, rows)
        assert not model.use_fused(False)
        plain = model(ids, cos[:60], sin[:60], caches, meta, rows)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
