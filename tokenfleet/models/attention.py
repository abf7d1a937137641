"""Attention over the paged KV cache.

The cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads,
head_dim]; a token at position p of a request lives in slot
block_ids[p // block_size] * block_size + p % block_size. Each step writes the new
tokens' K/V into their slots, then reads every sequence's context through its block
table. On CPU float32, decodes and short chunks (at most KERNEL_MAX_QUERY query tokens,
such as the last chunks of a long prompt cut to fit beside decodes) go to the fused C
kernel (kernels/paged_attention.c) in one call, which reads the cache in place; longer
chunks gather their blocks and call scaled_dot_product_attention, and elsewhere
everything does. A fused CUDA kernel would slot in the same way.

Decodes come first in the flattened batch (the runner orders them so), so their rows are
one slice and need no scatter.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenfleet.kernels import paged_attention

# Chunks of up to this many query tokens run in the C kernel. It reads a chunk's context
# once for all its queries but works each query out alone, so it costs about one decode
# per query token; SDPA gathers a copy of the context first and then works in matrix
# products. Measured (bench/attention_kernel.py: 30 layers, 9 heads of 64, one thread, AMD
# EPYC), kernel against gather + SDPA at context 8,000, float32 KV: 2 queries 53 ms
# against 248, 8 queries 112 against 246, 16 queries 215 against 314; at context 500, 16
# queries 17 against 24.
KERNEL_MAX_QUERY = 16


@dataclass(frozen=True)
class PrefillSeq:
    """A sequence with more than one query token this step (a prompt or a chunk of it)."""

    token_start: int  # offset of its first query token in the flattened batch
    num_query: int
    context_len: int  # tokens in its context after this step, queries included
    block_ids: torch.Tensor  # [num_blocks_needed]
    mask: torch.Tensor | None  # [num_query, context_len] bool; None = plain causal
    in_kernel: bool  # short enough for the kernel (where the kernel runs)


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    # Decodes (one query token each): rows [0, num_decodes) of the batch.
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes]
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSeq]
    # The kernel's sequences: the decodes, then the prefills with in_kernel.
    kernel_block_tables: torch.Tensor  # [num_kernel_seqs, max_blocks], padded with block 0
    kernel_context_lens: torch.Tensor  # [num_kernel_seqs]
    kernel_query_starts: torch.Tensor  # [num_kernel_seqs]: first row in the batch
    kernel_query_lens: torch.Tensor  # [num_kernel_seqs]

    @classmethod
    def build(
        cls,
        seqs: Sequence[tuple[int, int, Sequence[int]]],
        block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
        decode_table: np.ndarray | None = None,
    ) -> AttentionMetadata:
        """From (start_pos, num_query, block_ids) per sequence, in batch order, decodes first.

        The decodes (most of a busy step's rows) are laid out with numpy, not row by row:
        their block tables in one assignment, their slots from the table. `decode_table`,
        when given, holds the decodes' block ids as rows of one array (the runner's
        BlockTables; past a row's blocks, any valid id), and their `block_ids` are not read.
        """
        num_decodes = 0
        for _, num_query, _ in seqs:
            if num_query != 1:
                break
            num_decodes += 1
        starts_np = np.fromiter(
            (start for start, _, _ in seqs[:num_decodes]), np.int64, num_decodes
        )
        needed = starts_np // block_size + 1
        if decode_table is None:
            decode_table = _padded([ids for _, _, ids in seqs[:num_decodes]], needed)
        # Each decode's blocks up to its position, zeros after (the mask hides them).
        width = int(needed.max(initial=0))
        decode_np = decode_table[:num_decodes, :width].copy()
        decode_np[np.arange(width) >= needed[:, None]] = 0
        # The prefills (a prompt or a chunk of one each), row by row.
        prefill_slots: list[np.ndarray] = []
        kernel_tables: list[Sequence[int]] = []
        lens = (starts_np + 1).tolist()
        query_starts = list(range(num_decodes))
        query_lens = [1] * num_decodes
        prefills: list[PrefillSeq] = []
        offset = num_decodes
        for start, num_query, block_ids in seqs[num_decodes:]:
            assert num_query > 1, "decodes must come before prefills in the batch"
            context_len = start + num_query
            num_blocks = -(context_len // -block_size)
            pos = np.arange(start, context_len)
            ids = np.array(block_ids[:num_blocks], np.int64)
            prefill_slots.append(ids[pos // block_size] * block_size + pos % block_size)
            in_kernel = num_query <= KERNEL_MAX_QUERY
            prefills.append(
                PrefillSeq(
                    token_start=offset,
                    num_query=num_query,
                    context_len=context_len,
                    block_ids=torch.from_numpy(ids).to(device),
                    mask=_prefill_mask(start, num_query, sliding_window, device),
                    in_kernel=in_kernel,
                )
            )
            if in_kernel:
                kernel_tables.append(ids)
                lens.append(context_len)
                query_starts.append(offset)
                query_lens.append(num_query)
            offset += num_query
        kernel_np = _padded(kernel_tables, np.fromiter(map(len, kernel_tables), np.int64))
        max_blocks = max(width, kernel_np.shape[1])
        table_np = np.zeros((num_decodes + len(kernel_tables), max_blocks), np.int64)
        table_np[:num_decodes, :width] = decode_np
        table_np[num_decodes:, : kernel_np.shape[1]] = kernel_np
        decode_slots = decode_np[np.arange(num_decodes), needed - 1] * block_size + (
            starts_np % block_size
        )
        slots = np.concatenate([decode_slots, *prefill_slots])
        table = torch.from_numpy(table_np)
        key_pos = torch.arange(max_blocks * block_size)
        context_lens = torch.from_numpy(np.array(lens, np.int64))
        decode_lens = context_lens[:num_decodes, None]
        mask = key_pos[None, :] < decode_lens
        if sliding_window is not None:
            mask &= key_pos[None, :] > decode_lens - 1 - sliding_window
        table = table.to(device)
        context_lens = context_lens.to(device)
        return cls(
            slot_mapping=torch.from_numpy(slots).to(device),
            num_decodes=num_decodes,
            decode_block_tables=table[:num_decodes],
            decode_context_lens=context_lens[:num_decodes],
            decode_mask=mask[:, None, None, :].to(device),
            prefills=prefills,
            kernel_block_tables=table,
            kernel_context_lens=context_lens,
            kernel_query_starts=long_tensor(query_starts, device),
            kernel_query_lens=long_tensor(query_lens, device),
        )


def _padded(tables: Sequence[Sequence[int]], lengths: np.ndarray) -> np.ndarray:
    """The first `lengths[i]` ids of each table as the rows of a zeroed array, in one
    assignment (row-major, as a mask of each row's first columns orders them): a tensor per
    row costs ~20 us a row here, a tensor of padded lists ~1 us a row."""
    width = int(lengths.max(initial=0))
    table = np.zeros((len(tables), width), np.int64)
    firsts = (ids[:n] for ids, n in zip(tables, lengths.tolist(), strict=True))
    table[np.arange(width) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(firsts), np.int64, int(lengths.sum())
    )
    return table


def long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of Python ints: through numpy, ~5x faster than torch.tensor here."""
    return torch.from_numpy(np.array(values, np.int64)).to(device)


def _prefill_mask(
    start: int, num_query: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    if start == 0 and sliding_window is None:
        return None
    query_pos = torch.arange(start, start + num_query)[:, None]
    key_pos = torch.arange(start + num_query)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask.to(device)


class PagedAttention:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        use_kernel: bool = True,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.use_kernel = use_kernel

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], q's dtype or 16-bit
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H * D]
        hkv, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        prefills = meta.prefills
        if self.use_kernel and q.device.type == "cpu" and q.dtype == torch.float32:
            # One call for the decodes and short chunks; it leaves the other rows unset.
            out = paged_attention(
                q,
                k_cache,
                v_cache,
                meta.kernel_block_tables,
                meta.kernel_context_lens,
                meta.kernel_query_starts,
                meta.kernel_query_lens,
                self.head_dim**-0.5,
                self.sliding_window,
            )
            prefills = [seq for seq in prefills if not seq.in_kernel]
        else:
            out = torch.empty_like(q)
            n = meta.num_decodes
            if n:
                out[:n] = self._decode(q[:n], k_cache, v_cache, meta)
        for seq in prefills:
            rows = slice(seq.token_start, seq.token_start + seq.num_query)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, seq)
        return out.view(q.shape[0], -1)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The decodes without the kernel: gather each one's blocks, then SDPA."""
        b, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        table = meta.decode_block_tables
        # [B, blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
        keys = k_cache[table].view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)
        values = v_cache[table].view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)
        # The query heads sharing a KV head become that head's rows: no K/V repeat.
        grouped = q.view(b, hkv, self.group, d)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=meta.decode_mask)
        return out.reshape(b, self.num_heads, d)

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq
    ) -> torch.Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        keys = k_cache[seq.block_ids].view(-1, hkv, d)[: seq.context_len].to(q.dtype)
        values = v_cache[seq.block_ids].view(-1, hkv, d)[: seq.context_len].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            enable_gqa=self.group > 1,
        )
        return out.squeeze(0).transpose(0, 1)
