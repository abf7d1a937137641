"""The KV-cache manager: speaks in requests, over a BlockPool that speaks in blocks.

A request's blocks, in order, hold its tokens' K/V; block i holds positions
[i*block_size, (i+1)*block_size). Full blocks are hashed by chaining
hash(parent_hash, tokens), so equal prefixes share blocks across requests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tokenfleet.core.block_pool import BlockPool, KVCacheBlock
from tokenfleet.core.request import Request

# Parent of the first block. An int, not None: hash(None) differs between processes
# before Python 3.12, and the router must compute the same hashes as the engine.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def root_hash(cache_salt: str | None) -> int:
    """The parent of a request's first block: ROOT_HASH, or with a salt a root of its own,
    so that no block of one salt's chain equals a block of another's (vLLM's cache_salt).
    From a digest of the salt, not hash(str): that differs between processes."""
    if not cache_salt:
        return ROOT_HASH
    digest = hashlib.sha256(cache_salt.encode()).digest()
    return hash((ROOT_HASH, int.from_bytes(digest[:8], "little")))


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    hashes: list[int] | None = None,
    cache_salt: str | None = None,
    num_tokens: int | None = None,
) -> list[int]:
    """Extend `hashes` (the hashes already known) to every full block of `token_ids`, or
    of its first `num_tokens` (those known, when placeholders follow)."""
    hashes = [] if hashes is None else hashes
    parent = hashes[-1] if hashes else root_hash(cache_salt)
    end = len(token_ids) if num_tokens is None else num_tokens
    for start in range(len(hashes) * block_size, end - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of which found in the cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached run of the request's full blocks, and its token count.

        The last token is never served from the cache: its forward pass gives the logits
        the next token is sampled from. Nor is any token of a prompt whose logprobs are
        wanted (each needs its logits).
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        if request.wants_prompt_logprobs:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            start = i * self.block_size
            tokens = tuple(request.all_token_ids[start : start + self.block_size])
            block = self.pool.get_cached_block(block_hash, tokens)
            if block is None:
                break
            blocks.append(block)
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> bool:
        return self._num_blocks_short(request, num_new_tokens, new_computed_blocks) <= 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens, or None (nothing changes).

        `new_computed_blocks` are prefix hits from get_computed_blocks for a request that
        has none yet; they are taken (ref-counted) before the new blocks.
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return None
        req_blocks = self.req_to_blocks.setdefault(request.req_id, [])
        self.pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        if new_computed_blocks:
            self._num_cached_blocks[request.req_id] = len(req_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(req_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def grow_in_place(self, request: Request, num_new_tokens: int, keep_free: int) -> bool:
        """allocate_slots for a request whose `num_new_tokens` fit in the blocks it already
        holds (most decodes), with `keep_free` more blocks asked to stay free as
        can_allocate would count them; False, with nothing changed, for any other request
        (it takes allocate_slots' way). A few operations where allocate_slots is a dozen."""
        blocks = self.req_to_blocks.get(request.req_id)
        if blocks is None:
            return False
        block_size = self.block_size
        end = request.num_computed_tokens + num_new_tokens
        num_held = len(blocks)
        if end > num_held * block_size:
            return False
        # The tokens fit in the blocks held: only a reserve asked for can be short.
        if keep_free and cdiv(end, block_size) - num_held + keep_free > len(self.pool.free_queue):
            return False
        if self.enable_caching:
            self._cache_full_blocks(request, end)
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self._num_cached_blocks.pop(request.req_id, None)
        self.pool.free_blocks(reversed(blocks))

    def _num_blocks_short(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int:
        num_held = len(self.req_to_blocks.get(request.req_id, ())) + len(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - num_held
        # A hit on a free cached block takes it out of the free queue too.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return num_needed - (self.pool.num_free_blocks - num_free_hits)

    def _update_block_hashes(self, request: Request) -> None:
        compute_block_hashes(
            request.all_token_ids,
            self.block_size,
            request.block_hashes,
            request.cache_salt,
            request.num_known_tokens,
        )

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that this step fills with known tokens (a block that holds a
        placeholder waits for a later step's allocation)."""
        num_cached = self._num_cached_blocks.get(request.req_id, 0)
        if num_tokens < (num_cached + 1) * self.block_size:
            return  # no block filled (most decodes: one in block_size fills one)
        num_full = min(num_tokens, request.num_known_tokens) // self.block_size
        if num_full <= num_cached:
            return
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.req_id]
        for i in range(num_cached, num_full):
            start = i * self.block_size
            tokens = tuple(request.all_token_ids[start : start + self.block_size])
            self.pool.cache_full_block(blocks[i], request.block_hashes[i], tokens)
        self._num_cached_blocks[request.req_id] = num_full


class HeldBlocks:
    """The distinct blocks a changing set of requests hold (a block shared by a prefix hit
    counts once), kept up to date from each request's block list instead of counted over
    every block at each call: a request's list only grows while it holds it (allocate_slots
    extends it; free pops it, and a request allocated again gets a new list), so each call
    adds the blocks appended since the previous one, and drops the requests gone or whose
    list was replaced. A call costs one look per request, not one per block."""

    def __init__(self) -> None:
        self._refs: dict[KVCacheBlock, int] = {}  # holders of each block counted
        self._seen: dict[str, tuple[list[KVCacheBlock], int]] = {}  # list, blocks counted

    def count(self, lists: dict[str, list[KVCacheBlock]]) -> int:
        """Distinct blocks held by the requests whose block lists `lists` gives now."""
        refs, seen = self._refs, self._seen
        for req_id, blocks in lists.items():
            entry = seen.get(req_id)
            if entry is None or entry[0] is not blocks:  # new, or allocated again
                if entry is not None:
                    self._drop(entry)
                num = 0
            else:
                num = entry[1]
                if len(blocks) == num:
                    continue
            for block in blocks[num:]:
                refs[block] = refs.get(block, 0) + 1
            seen[req_id] = (blocks, len(blocks))
        # Every request of `lists` is in `seen` now: any more there are gone.
        if len(seen) > len(lists):
            for req_id in [r for r in seen if r not in lists]:
                self._drop(seen.pop(req_id))
        return len(refs)

    def _drop(self, entry: tuple[list[KVCacheBlock], int]) -> None:
        """Uncount the blocks counted of one request's list."""
        refs = self._refs
        blocks, num = entry
        for block in blocks[:num]:
            held = refs[block] - 1
            if held:
                refs[block] = held
            else:
                del refs[block]
