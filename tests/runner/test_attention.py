"""Paged attention: the fused C decode kernel and the torch gather path give the same
result as plain attention over each sequence's contiguous K/V."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from tokenfleet.kernels import paged_attention_lib, paged_attention_splits_contexts
from tokenfleet.models.attention import AttentionMetadata, PagedAttention


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """One decode query [H, D] against contiguous k, v [L, Hkv, D]."""
    heads, kv_heads = q.shape[0], k.shape[1]
    length = k.shape[0]
    start = max(0, length - window) if window else 0
    k = k[start:].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    v = v[start:].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q[:, None, :], k, v)[:, 0, :]


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [(9, 3, 64, 16, None), (4, 4, 32, 4, None), (8, 2, 24, 8, 5), (6, 1, 16, 2, None)],
)
def test_decode_attention_matches_contiguous_attention(
    use_kernel: bool, heads: int, kv_heads: int, head_dim: int, block_size: int, window: int | None
) -> None:
    if use_kernel and paged_attention_lib() is None:
        pytest.fail("the C kernel did not build: is a C compiler installed?")
    gen = torch.Generator().manual_seed(0)
    num_blocks = 64
    lengths = [1, 3, block_size, block_size + 1, 5 * block_size - 1, 37]
    k_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, tables, expected = [], [], []
    q = torch.randn(len(lengths), heads, head_dim, generator=gen)
    k_new = torch.randn(len(lengths), kv_heads, head_dim, generator=gen)
    v_new = torch.randn(len(lengths), kv_heads, head_dim, generator=gen)
    for length in lengths:
        n = -(length // -block_size)
        ids, perm = perm[:n], perm[n:]
        tables.append(ids)
        seqs.append((length - 1, 1, ids))  # the last position is this step's query
    meta = AttentionMetadata.build(seqs, block_size, torch.device("cpu"), window)
    attn = PagedAttention(heads, kv_heads, head_dim, window, use_kernel=use_kernel)
    out = attn.forward(q, k_new, v_new, k_cache[0], k_cache[1], meta).view(-1, heads, head_dim)
    for i, length in enumerate(lengths):
        k = k_cache[0][tables[i]].reshape(-1, kv_heads, head_dim)[:length]
        v = k_cache[1][tables[i]].reshape(-1, kv_heads, head_dim)[:length]
        assert torch.equal(k[-1], k_new[i]) and torch.equal(v[-1], v_new[i])  # slot written
        expected.append(_reference(q[i], k, v, window))
    torch.testing.assert_close(out, torch.stack(expected), atol=2e-6, rtol=1e-5)


def _reference_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """A chunk's queries [n, H, D], the last n positions of contiguous k, v [L, Hkv, D]."""
    n, length = q.shape[0], k.shape[0]
    ends = [length - n + i + 1 for i in range(n)]
    return torch.stack([_reference(q[i], k[:e], v[:e], window) for i, e in enumerate(ends)])


class _Batch:
    """A step's K/V cache of random blocks (a random pick of the pool per sequence) and its
    new rows, for sequences given as (context after this step, query tokens)."""

    def __init__(
        self,
        shapes: list[tuple[int, int]],
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        kv_dtype: torch.dtype,
        seed: int,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(c // -block_size) for c, _ in shapes) + 4
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
        self.cache = cache.to(kv_dtype)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        total = sum(n for _, n in shapes)
        self.q = torch.randn(total, heads, head_dim, generator=gen)
        self.k_new = torch.randn(total, kv_heads, head_dim, generator=gen)
        self.v_new = torch.randn(total, kv_heads, head_dim, generator=gen)
        self.shapes = shapes
        self.seqs: list[tuple[int, int, list[int]]] = []
        self.tables: list[list[int]] = []
        for context, n in shapes:
            blocks = -(context // -block_size)
            ids, perm = perm[:blocks], perm[blocks:]
            self.tables.append(ids)
            self.seqs.append((context - n, n, ids))

    def contexts(self) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Per sequence: its first query row, its query tokens, and its whole K and V (the
        context after this step) read back contiguous from the cache, in the cache's type."""
        kv_heads, head_dim = self.cache.shape[3], self.cache.shape[4]
        row = 0
        for (context, n), ids in zip(self.shapes, self.tables, strict=True):
            k = self.cache[0][ids].reshape(-1, kv_heads, head_dim)[:context]
            v = self.cache[1][ids].reshape(-1, kv_heads, head_dim)[:context]
            yield row, n, k, v
            row += n


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [(9, 3, 64, 16, None), (8, 2, 128, 16, 21), (8, 2, 24, 8, 5), (6, 1, 16, 2, None)],
)
def test_chunks_and_decodes_in_one_batch_match_contiguous_attention(
    use_kernel: bool,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    kv_dtype: torch.dtype,
) -> None:
    """Decodes, short chunks at the end of a context (the kernel's, more than one tile of
    8 rows among them), a chunk longer than KERNEL_MAX_QUERY and a whole prompt, in one
    batch: every row equals causal attention over the sequence's contiguous K/V. A 16-bit
    cache holds the new K/V rounded to its type, and attention reads exactly those."""
    if use_kernel and paged_attention_lib() is None:
        pytest.fail("the C kernel did not build: is a C compiler installed?")
    # (context after this step, query tokens): decodes first, as the runner orders them
    shapes = [(5, 1), (3 * block_size, 1), (40, 2), (7, 7), (90, 9), (61, 16), (100, 17), (33, 33)]
    batch = _Batch(shapes, heads, kv_heads, head_dim, block_size, kv_dtype, seed=1)
    cache, q, k_new, v_new = batch.cache, batch.q, batch.k_new, batch.v_new
    meta = AttentionMetadata.build(batch.seqs, block_size, torch.device("cpu"), window)
    assert [p.in_kernel for p in meta.prefills] == [True, True, True, True, False, False]
    attn = PagedAttention(heads, kv_heads, head_dim, window, use_kernel=use_kernel)
    out = attn.forward(q, k_new, v_new, cache[0], cache[1], meta).view(-1, heads, head_dim)
    expected = []
    for row, n, k, v in batch.contexts():
        assert k.dtype == kv_dtype
        assert torch.equal(k[-n:], k_new[row : row + n].to(kv_dtype))  # written
        assert torch.equal(v[-n:], v_new[row : row + n].to(kv_dtype))
        expected.append(_reference_chunk(q[row : row + n], k.float(), v.float(), window))
    torch.testing.assert_close(out, torch.cat(expected), atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 1500], ids=["causal", "window"])
def test_long_contexts_split_across_threads_match_contiguous_attention(
    kv_dtype: torch.dtype, window: int | None
) -> None:
    """With two threads the kernel cuts a context longer than its 1,024-key segments into
    segments that threads take apart and merges their softmaxes: decodes and short chunks
    over 2,500-4,100 tokens (segments of the window's start left empty among them) give
    plain attention's result, as one thread's single pass does. Only the AVX-512 path
    splits; the portable one (a CPU without AVX-512) gives the same bits at both counts."""
    if paged_attention_lib() is None:
        pytest.fail("the C kernel did not build: is a C compiler installed?")
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    shapes = [(5, 1), (2500, 1), (1024, 1), (3000, 4), (4097, 9), (2100, 16)]
    batch = _Batch(shapes, heads, kv_heads, head_dim, block_size, kv_dtype, seed=2)
    cache, q, k_new, v_new = batch.cache, batch.q, batch.k_new, batch.v_new
    meta = AttentionMetadata.build(batch.seqs, block_size, torch.device("cpu"), window)
    assert all(p.in_kernel for p in meta.prefills)
    attn = PagedAttention(heads, kv_heads, head_dim, window)
    threads = torch.get_num_threads()
    outs = {}
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            out = attn.forward(q, k_new, v_new, cache[0], cache[1], meta)
            outs[n_threads] = out.view(-1, heads, head_dim)
    finally:
        torch.set_num_threads(threads)
    expected = [
        _reference_chunk(q[row : row + n], k.float(), v.float(), window)
        for row, n, k, v in batch.contexts()
    ]
    for out in outs.values():
        torch.testing.assert_close(out, torch.cat(expected), atol=3e-6, rtol=1e-5)
    if (
        paged_attention_splits_contexts()
    ):  # the AVX-512 path: the split ran, its sums round otherwise
        assert not torch.equal(outs[1], outs[2])
    else:  # the portable path (no AVX-512 on this CPU): one pass at any thread count
        assert torch.equal(outs[1], outs[2])


def test_loading_the_kernels_leaves_subnormal_floats_alone_in_the_process() -> None:
    """A library linked with -ffast-math sets the CPU's flush-to-zero flags for the whole
    process as it loads; ours are compiled with it but linked without. Checked in a fresh
    process (this one may have loaded them already)."""
    import subprocess
    import sys

    code = (
        "import torch, tokenfleet.kernels as k\n"
        "assert k.paged_attention_lib() is not None and k.elementwise_lib() is not None\n"
        "x = 5e-324\n"
        "assert 0 < x * 1.0, 'subnormal doubles flushed'\n"
        "assert (torch.tensor([1e-40]) * 1.0).item() > 0, 'subnormal floats flushed'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
