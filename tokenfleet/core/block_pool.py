"""A fixed pool of KV-cache blocks: ref counts, the free queue, and the prefix cache.

No tensors here: a block is an id into the runner's KV tensors.

    free queue (LRU order, evicted from the head)
    head -> [b7 cached] <-> [b3] <-> [b9 cached] <-> ... <-> [b4 cached] <- tail
             ^ next allocation takes this one, and only then forgets its hash

A block with ref_cnt 0 sits in the free queue, cached (it still holds a hash and valid
K/V) or not. A prefix hit on a cached free block takes it out of the middle of the queue
in O(1). Eviction is lazy: a cached block keeps its hash until it is reallocated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        # The block's tokens, compared on every hit so that a hash collision is a miss.
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and removal from the middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting their cached hashes."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self.free_queue)} are free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(
        self, block: KVCacheBlock, block_hash: int, token_ids: tuple[int, ...]
    ) -> None:
        """Register a full block under its chained hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail of the free queue.

        Callers pass a request's blocks tail first, so that among blocks freed together
        the tail (least likely to be shared) is evicted before the prefix.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, since a
        running request's blocks would otherwise never be cached again."""
        if self.num_used_blocks:
            return False
        for block in list(self.cached.values()):
            self._evict(block)
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1
