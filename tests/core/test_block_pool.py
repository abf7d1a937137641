"""BlockPool and FreeBlockQueue: exact block ids, ref counts and free-queue order."""

from __future__ import annotations

import pytest

from tokenfleet.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool_allocates_in_id_order() -> None:
    pool = BlockPool(6)
    assert queue_ids(pool) == [0, 1, 2, 3, 4, 5]
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]
    assert queue_ids(pool) == [5]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    assert pool.num_used_blocks == 5


def test_get_zero_blocks_changes_nothing() -> None:
    pool = BlockPool(3)
    assert pool.get_new_blocks(0) == []
    assert queue_ids(pool) == [0, 1, 2]


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockPool(0)


def test_free_appends_to_tail_in_the_order_given() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)  # 0, 1, 2
    pool.free_blocks(reversed(blocks))  # tail first, as the KV manager frees
    assert queue_ids(pool) == [3, 4, 2, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0, 0]
    # The next allocations take the untouched blocks, then the freed tail before the head.
    assert ids(pool.get_new_blocks(3)) == [3, 4, 2]
    assert queue_ids(pool) == [1, 0]


def test_shared_block_joins_queue_only_at_ref_zero() -> None:
    pool = BlockPool(3)
    [b0] = pool.get_new_blocks(1)
    pool.touch([b0])
    assert b0.ref_cnt == 2
    pool.free_blocks([b0])
    assert b0.ref_cnt == 1
    assert queue_ids(pool) == [1, 2]
    pool.free_blocks([b0])
    assert b0.ref_cnt == 0
    assert queue_ids(pool) == [1, 2, 0]


def test_double_free_asserts() -> None:
    pool = BlockPool(2)
    [b0] = pool.get_new_blocks(1)
    pool.free_blocks([b0])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b0])
    assert b0.ref_cnt == 0
    assert queue_ids(pool) == [1, 0]


def test_asking_for_more_blocks_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 are free"):
        pool.get_new_blocks(2)
    assert queue_ids(pool) == [3]
    assert pool.blocks[3].ref_cnt == 0


def test_touch_removes_cached_free_block_from_middle_of_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_block(blocks[2], 222, (2, 2))
    pool.free_blocks(blocks)  # queue: 0 1 2 3 4
    assert queue_ids(pool) == [0, 1, 2, 3, 4]
    hit = pool.get_cached_block(222, (2, 2))
    assert hit is blocks[2]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert queue_ids(pool) == [0, 1, 3, 4]
    assert len(pool.free_queue) == 4
    assert hit.prev_free is None and hit.next_free is None
    # Its neighbours are linked to each other directly.
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    # Still cached: touching does not evict.
    assert pool.cached == {222: hit}
    assert hit.block_hash == 222
    assert pool.num_evictions == 0


def test_touch_head_and_tail_of_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks)
    pool.touch([blocks[0]])
    assert queue_ids(pool) == [1, 2]
    pool.touch([blocks[2]])
    assert queue_ids(pool) == [1]
    pool.touch([blocks[1]])
    assert queue_ids(pool) == []
    with pytest.raises(IndexError):
        pool.free_queue.popleft()
    with pytest.raises(ValueError, match="asked for 1 blocks, 0 are free"):
        pool.get_new_blocks(1)


def test_touch_in_use_block_only_counts_a_reference() -> None:
    pool = BlockPool(3)
    [b0] = pool.get_new_blocks(1)
    pool.touch([b0])
    assert b0.ref_cnt == 2
    assert queue_ids(pool) == [1, 2]


def test_lazy_eviction_keeps_hash_until_reallocated() -> None:
    pool = BlockPool(3)
    b0, b1, b2 = pool.get_new_blocks(3)
    pool.cache_full_block(b0, 100, (1, 2))
    pool.cache_full_block(b1, 101, (3, 4))
    pool.free_blocks([b1, b0])  # tail first: queue 1, 0
    # Freed but still cached and hittable.
    assert pool.cached == {100: b0, 101: b1}
    assert pool.num_cached_blocks == 2
    assert pool.get_cached_block(100, (1, 2)) is b0
    assert pool.num_evictions == 0
    # Reallocating the head of the queue (b1) evicts it, and only it.
    assert ids(pool.get_new_blocks(1)) == [1]
    assert b1.block_hash is None
    assert b1.token_ids is None
    assert pool.cached == {100: b0}
    assert pool.get_cached_block(101, (3, 4)) is None
    assert pool.num_evictions == 1
    # An uncached block leaving the queue is not an eviction.
    pool.free_blocks([b2])
    assert queue_ids(pool) == [0, 2]
    assert ids(pool.get_new_blocks(1)) == [0]
    assert pool.num_evictions == 2
    assert pool.cached == {}
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.num_evictions == 2


def test_first_writer_wins_on_duplicate_hash() -> None:
    pool = BlockPool(3)
    b0, b1, _ = pool.get_new_blocks(3)
    pool.cache_full_block(b0, 7, (5, 6))
    pool.cache_full_block(b1, 7, (5, 6))
    assert pool.cached == {7: b0}
    assert b0.block_hash == 7
    assert b1.block_hash is None
    assert b1.token_ids is None
    assert pool.get_cached_block(7, (5, 6)) is b0
    # Freeing and reallocating the loser does not disturb the winner's entry.
    pool.free_blocks([b1])
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.cached == {7: b0}
    assert pool.num_evictions == 0


def test_cache_full_block_keeps_a_blocks_first_hash() -> None:
    pool = BlockPool(2)
    [b0] = pool.get_new_blocks(1)
    pool.cache_full_block(b0, 1, (1,))
    pool.cache_full_block(b0, 2, (2,))
    assert pool.cached == {1: b0}
    assert b0.block_hash == 1
    assert b0.token_ids == (1,)


def test_hash_collision_with_different_tokens_is_a_miss() -> None:
    pool = BlockPool(2)
    [b0] = pool.get_new_blocks(1)
    pool.cache_full_block(b0, 42, (1, 2, 3, 4))
    assert pool.get_cached_block(42, (1, 2, 3, 4)) is b0
    assert pool.get_cached_block(42, (1, 2, 3, 5)) is None
    assert pool.get_cached_block(43, (1, 2, 3, 4)) is None
    # The colliding writer does not replace the cached block either.
    [b1] = pool.get_new_blocks(1)
    pool.cache_full_block(b1, 42, (1, 2, 3, 5))
    assert pool.cached == {42: b0}
    assert pool.get_cached_block(42, (1, 2, 3, 5)) is None


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    [b0] = pool.get_new_blocks(1)
    pool.cache_full_block(b0, 9, (1,))
    assert pool.cached == {}
    assert b0.block_hash is None
    assert pool.get_cached_block(9, (1,)) is None


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(3)
    b0, b1, b2 = pool.get_new_blocks(3)
    pool.cache_full_block(b0, 1, (1,))
    pool.cache_full_block(b1, 2, (2,))
    pool.free_blocks([b1, b0])
    assert pool.reset_prefix_cache() is False  # b2 is still in use
    assert set(pool.cached) == {1, 2}
    pool.free_blocks([b2])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert b0.block_hash is None and b1.block_hash is None
    assert pool.num_evictions == 2
    assert queue_ids(pool) == [1, 0, 2]


def test_free_block_queue_remove_from_middle_and_iteration() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 4
    queue.remove(blocks[1])
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 3]
    assert len(queue) == 2
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [0, 3, 2]
    assert queue.popleft() is blocks[0]
    assert [b.block_id for b in queue] == [3, 2]
    with pytest.raises(AssertionError, match="not in the free queue"):
        queue.remove(blocks[0])
    with pytest.raises(AssertionError):
        queue.append(blocks[3])  # already in the queue
