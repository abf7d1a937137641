"""KVCacheManager: exact block ids, prefix hits, eviction order and pool invariants."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

import tokenfleet.core.kv_cache as kv_cache_module
from tokenfleet.core.block_pool import KVCacheBlock
from tokenfleet.core.kv_cache import (
    ROOT_HASH,
    HeldBlocks,
    KVCacheManager,
    cdiv,
    compute_block_hashes,
    hash_block_tokens,
)
from tokenfleet.core.request import Request
from tokenfleet.core.sampling_params import SamplingParams


def make_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(), arrival_time=0.0)


def ids(blocks: list[KVCacheBlock] | None) -> list[int]:
    assert blocks is not None
    return [b.block_id for b in blocks]


def queue_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def cached_ids(kv: KVCacheManager) -> set[int]:
    return {b.block_id for b in kv.pool.cached.values()}


def admit(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """Schedule a waiting request's whole remaining prompt, as the scheduler does."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return ids(new), num_hit_tokens


def snapshot(kv: KVCacheManager) -> object:
    return (
        queue_ids(kv),
        [b.ref_cnt for b in kv.pool.blocks],
        {h: b.block_id for h, b in kv.pool.cached.items()},
        {r: [b.block_id for b in bs] for r, bs in kv.req_to_blocks.items()},
        dict(kv._num_cached_blocks),
        kv.pool.num_evictions,
    )


# -- hashing ------------------------------------------------------------------------


def test_block_hashes_are_chained_and_ignore_the_partial_block() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7]
    hashes = compute_block_hashes(tokens, 3)
    h0 = hash_block_tokens(ROOT_HASH, (1, 2, 3))
    h1 = hash_block_tokens(h0, (4, 5, 6))
    assert hashes == [h0, h1]
    # Same block tokens under a different parent hash differently.
    assert compute_block_hashes([9, 9, 9, 4, 5, 6], 3)[1] != h1
    # Extending a known list only appends.
    known = [h0]
    assert compute_block_hashes([*tokens, 8, 9], 3, known) is known
    assert known == [h0, h1, hash_block_tokens(h1, (7, 8, 9))]


def test_held_blocks_counts_shared_blocks_once_and_follows_a_request_allocated_again() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=2)
    held = HeldBlocks()
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [1, 2, 3, 4, 9])
    admit(kv, a)  # 3 blocks, the first two full and cached
    _, num_hit = admit(kv, b)  # shares a's two full blocks
    assert num_hit == 4 and kv.req_to_blocks["b"][:2] == kv.req_to_blocks["a"][:2]
    assert held.count(dict(kv.req_to_blocks)) == 4  # 3 of a's, b's last one
    assert held.count({"a": kv.req_to_blocks["a"]}) == 3  # b left the set
    # a freed and allocated again between two counts: a new list, none of the old blocks.
    kv.free(a)
    a.num_computed_tokens = 0
    kv.allocate_slots(a, 1)
    assert held.count({"a": kv.req_to_blocks["a"]}) == 1
    kv.allocate_slots(a, 2)  # grows: 2 tokens in 2 blocks
    assert held.count({"a": kv.req_to_blocks["a"], "b": kv.req_to_blocks["b"]}) == 1 + 3
    assert held.count({}) == 0


def test_cdiv() -> None:
    assert [cdiv(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


# -- allocate_slots -----------------------------------------------------------------


def test_allocate_slots_returns_exact_new_block_ids() -> None:
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(10)))
    assert ids(kv.allocate_slots(a, 10)) == [0, 1, 2]
    a.num_computed_tokens = 10
    # Full blocks are registered in the prefix cache at once, the partial one is not.
    assert kv.pool.cached == {
        a.block_hashes[0]: kv.pool.blocks[0],
        a.block_hashes[1]: kv.pool.blocks[1],
    }
    assert a.block_hashes == compute_block_hashes(list(range(10)), 4)
    # Decode steps: 11 and 12 tokens fit in 3 blocks, the 13th needs block 3.
    for expected in ([], [], [3]):
        a.append_output_token(50)
        assert ids(kv.allocate_slots(a, 1)) == expected
        a.num_computed_tokens += 1
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert cached_ids(kv) == {0, 1, 2}
    # A chunked prefill: 3 tokens, then 6 more.
    b = make_request("b", list(range(100, 109)))
    assert ids(kv.allocate_slots(b, 3)) == [4]
    b.num_computed_tokens = 3
    assert cached_ids(kv) == {0, 1, 2}
    assert ids(kv.allocate_slots(b, 6)) == [5, 6]
    b.num_computed_tokens = 9
    assert cached_ids(kv) == {0, 1, 2, 4, 5}
    assert kv.get_block_ids("b") == [4, 5, 6]
    assert kv.num_free_blocks == 1
    assert kv.usage == 7 / 8
    assert kv.get_block_ids("nobody") == []


def test_allocate_slots_returns_none_and_changes_nothing_when_short() -> None:
    kv = KVCacheManager(4, 4)
    a = make_request("a", list(range(12)))
    assert ids(kv.allocate_slots(a, 12)) == [0, 1, 2]
    a.num_computed_tokens = 12
    b = make_request("b", list(range(100, 108)))
    before = snapshot(kv)
    assert not kv.can_allocate(b, 8)
    assert kv.allocate_slots(b, 8) is None
    assert snapshot(kv) == before
    assert kv.num_free_blocks == 1
    assert list(kv.req_to_blocks) == ["a"]
    # Exactly enough fits.
    assert kv.can_allocate(b, 4)
    assert ids(kv.allocate_slots(b, 4)) == [3]


def test_allocate_slots_short_with_in_use_prefix_hit_changes_nothing() -> None:
    kv = KVCacheManager(4, 4)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    b = make_request("b", [0, 1, 2, 3, 90, 91, 92, 93, 94, 95, 96, 97])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert ids(hits) == [0]
    assert num_hit_tokens == 4
    before = snapshot(kv)
    # Needs 2 new blocks, 1 is free.
    assert kv.allocate_slots(b, 8, hits) is None
    assert snapshot(kv) == before
    assert kv.pool.blocks[0].ref_cnt == 1
    assert kv.num_free_blocks == 1


def test_prefix_hit_on_free_cached_blocks_pulls_them_from_the_queue() -> None:
    kv = KVCacheManager(4, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert admit(kv, a) == ([0, 1, 2], 0)
    kv.free(a)
    assert queue_ids(kv) == [3, 2, 1, 0]
    assert cached_ids(kv) == {0, 1}
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 0, 0, 0]

    # 9 tokens, 2 cached blocks: would need 3 new blocks, but only 4 - 2 hits are free.
    short = make_request("short", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    hits, num_hit_tokens = kv.get_computed_blocks(short)
    assert (ids(hits), num_hit_tokens) == ([0, 1], 4)
    before = snapshot(kv)
    assert not kv.can_allocate(short, 5, hits)
    assert kv.allocate_slots(short, 5, hits) is None
    assert snapshot(kv) == before

    # 7 tokens: 2 hits + 2 new blocks fit exactly, and the hits leave the free queue.
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert (ids(hits), num_hit_tokens) == ([0, 1], 4)
    assert ids(kv.allocate_slots(b, 3, hits)) == [3, 2]
    assert kv.get_block_ids("b") == [0, 1, 3, 2]
    assert queue_ids(kv) == []
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [1, 1, 1, 1]
    # The hits were not evicted; block 3 now caches b's third block ([9, 9]).
    assert cached_ids(kv) == {0, 1, 3}
    assert kv.pool.cached[b.block_hashes[2]] is kv.pool.blocks[3]
    assert kv.pool.num_evictions == 0


# -- get_computed_blocks ------------------------------------------------------------


def test_shared_prefix_hits_across_requests_with_exact_ids() -> None:
    kv = KVCacheManager(16, 4)
    a = make_request("a", list(range(14)))  # blocks 0-3, 3 full
    assert admit(kv, a) == ([0, 1, 2, 3], 0)
    # Shares a's first two blocks, then differs.
    b = make_request("b", [*range(8), 77, 9, 10, 11, 12])
    assert admit(kv, b) == ([4, 5], 8)
    assert kv.get_block_ids("b") == [0, 1, 4, 5]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:6]] == [2, 2, 1, 1, 1, 1]
    assert b.num_computed_tokens == 13
    # Shares all three full blocks of a.
    c = make_request("c", [*range(12), 40, 41])
    assert admit(kv, c) == ([6], 12)
    assert kv.get_block_ids("c") == [0, 1, 2, 6]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:7]] == [3, 3, 2, 1, 1, 1, 1]
    # Freeing drops one reference per holder; nothing shared joins the queue.
    kv.free(c)
    assert [blk.ref_cnt for blk in kv.pool.blocks[:7]] == [2, 2, 1, 1, 1, 1, 0]
    assert queue_ids(kv)[-1] == 6


def test_prompt_of_exactly_two_full_blocks_hits_one_block() -> None:
    kv = KVCacheManager(8, 4)
    admit(kv, make_request("a", list(range(8))))
    assert cached_ids(kv) == {0, 1}
    b = make_request("b", list(range(8)))
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert ids(hits) == [0]
    assert num_hit_tokens == 4
    # One more token and both blocks hit, still leaving the last token to compute.
    c = make_request("c", [*range(8), 8])
    hits, num_hit_tokens = kv.get_computed_blocks(c)
    assert ids(hits) == [0, 1]
    assert num_hit_tokens == 8
    # A one-block prompt hits nothing.
    d = make_request("d", list(range(4)))
    assert kv.get_computed_blocks(d) == ([], 0)


def test_lookup_stops_at_first_miss_even_if_later_blocks_are_cached() -> None:
    kv = KVCacheManager(3, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert admit(kv, a) == ([0, 1, 2], 0)
    kv.free(a)  # queue 2, 1, 0
    # Evict block 2 (uncached) and block 1 (a's [3, 4]); block 0 ([1, 2]) stays.
    filler = make_request("filler", [8, 8, 8])
    assert admit(kv, filler) == ([2, 1], 0)
    assert cached_ids(kv) == {0, 2}  # 2 now holds filler's [8, 8]
    kv.free(filler)
    # Block 0 hits, block 1 ([3, 4]) misses.
    b = make_request("b", [1, 2, 3, 4, 5])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert (ids(hits), num_hit_tokens) == ([0], 2)

    kv2 = KVCacheManager(3, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv2, a)
    kv2.free(a)  # queue 2, 1, 0: block 0 ([1, 2]) is evicted last ...
    # ... so force it out while block 1 ([3, 4], chained on [1, 2]) stays cached.
    kv2.pool.touch([kv2.pool.blocks[2], kv2.pool.blocks[1]])
    kv2.pool.get_new_blocks(1)  # evicts block 0
    kv2.pool.free_blocks([kv2.pool.blocks[1], kv2.pool.blocks[2], kv2.pool.blocks[0]])
    assert cached_ids(kv2) == {1}
    b = make_request("b", [1, 2, 3, 4, 5])
    assert kv2.get_computed_blocks(b) == ([], 0)


def test_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache_module, "hash_block_tokens", lambda parent, tokens: 5)
    kv = KVCacheManager(4, 2)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    assert kv.pool.cached == {5: kv.pool.blocks[0]}
    b = make_request("b", [7, 7, 7])
    assert b.block_hashes == []
    assert kv.get_computed_blocks(b) == ([], 0)
    assert b.block_hashes == [5]
    c = make_request("c", [1, 2, 3])
    hits, num_hit_tokens = kv.get_computed_blocks(c)
    assert (ids(hits), num_hit_tokens) == ([0], 2)


def test_prefix_counters_are_exact() -> None:
    kv = KVCacheManager(16, 4)
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (0, 0)
    admit(kv, make_request("a", list(range(10))))
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (10, 0)
    admit(kv, make_request("b", list(range(10))))
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (20, 8)
    admit(kv, make_request("c", list(range(8))))
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (28, 12)
    admit(kv, make_request("d", [99, *range(12)]))
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (41, 12)


def test_caching_disabled_never_hits_nor_counts() -> None:
    kv = KVCacheManager(8, 4, enable_caching=False)
    assert admit(kv, make_request("a", list(range(10)))) == ([0, 1, 2], 0)
    assert kv.pool.cached == {}
    assert admit(kv, make_request("b", list(range(10)))) == ([3, 4, 5], 0)
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (0, 0)


# -- free and eviction order --------------------------------------------------------


def test_free_returns_tail_first_and_evicts_tail_before_prefix() -> None:
    kv = KVCacheManager(6, 2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0-3, 0-2 cached
    admit(kv, a)
    b = make_request("b", [11, 12, 13])  # blocks 4-5, 4 cached
    assert admit(kv, b) == ([4, 5], 0)
    assert cached_ids(kv) == {0, 1, 2, 4}
    kv.free(a)
    kv.free(b)
    assert kv.req_to_blocks == {}
    assert kv.num_free_blocks == 6
    # a's tail first, then b's (freed later: more recently used) tail first.
    assert queue_ids(kv) == [3, 2, 1, 0, 5, 4]
    hashes = {b.block_id: b.block_hash for b in kv.pool.cached.values()}
    evicted_order = []
    for _ in range(6):
        [blk] = kv.pool.get_new_blocks(1)
        if blk.block_id in hashes:
            evicted_order.append(blk.block_id)
            assert hashes[blk.block_id] not in kv.pool.cached
    assert evicted_order == [2, 1, 0, 4]
    assert kv.pool.num_evictions == 4
    assert kv.pool.cached == {}


def test_freed_prefix_outlives_another_requests_tail() -> None:
    """LRU across requests: a re-hit block moves to the back when freed again."""
    kv = KVCacheManager(5, 2)
    a = make_request("a", [1, 2, 3])  # blocks 0 (cached), 1
    admit(kv, a)
    kv.free(a)  # queue 2 3 4 1 0
    b = make_request("b", [1, 2, 5])  # hits block 0, new block 2
    assert admit(kv, b) == ([2], 2)
    assert queue_ids(kv) == [3, 4, 1]
    kv.free(b)
    assert queue_ids(kv) == [3, 4, 1, 2, 0]
    assert cached_ids(kv) == {0}
    assert ids(kv.pool.get_new_blocks(4)) == [3, 4, 1, 2]
    assert cached_ids(kv) == {0}
    assert ids(kv.pool.get_new_blocks(1)) == [0]
    assert cached_ids(kv) == set()


def test_preempt_and_readmit_hits_own_prefix() -> None:
    kv = KVCacheManager(8, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert admit(kv, a) == ([0, 1, 2], 0)
    a.append_output_token(6)
    assert ids(kv.allocate_slots(a, 1)) == []
    a.num_computed_tokens = 6
    a.append_output_token(7)
    # Preempt: free, recompute from zero.
    kv.free(a)
    a.num_computed_tokens = 0
    hits, num_hit_tokens = kv.get_computed_blocks(a)
    assert (ids(hits), num_hit_tokens) == ([0, 1, 2], 6)
    assert ids(kv.allocate_slots(a, 1, hits)) == [3]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert kv._num_cached_blocks["a"] == 3


# -- random operation sequences keep the pool consistent ----------------------------


# Prompts share long prefixes often, so that multi-block hits are common.
PROMPTS = st.builds(
    lambda prefix, suffix: (prefix + suffix)[:9] or [0],
    st.sampled_from([[], [0, 1], [0, 1, 1, 0], [0, 1, 1, 0, 1, 1, 0]]),
    st.lists(st.integers(0, 1), max_size=5),
)


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / admit / extend / free / preempt / lookup sequences.

    Alongside the manager it keeps a fake KV store (block id -> token per slot), written
    for every allocated token, so that every prefix hit is checked to hold exactly the
    tokens it claims, and no write ever lands in a shared or cached-with-other-tokens slot.
    """

    BLOCK_SIZE = 2
    NUM_BLOCKS = 7

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.pending: dict[str, Request] = {}  # added or preempted: holds no blocks
        self.live: dict[str, Request] = {}  # holds blocks
        self.content: dict[int, list[int | None]] = {}
        self.next_id = 0
        self.held = HeldBlocks()  # over the even-numbered live requests (a changing set)

    # -- helpers

    def _check_hits(self, request: Request, hits: list[KVCacheBlock], num_hit: int) -> None:
        bs = self.BLOCK_SIZE
        assert num_hit == len(hits) * bs
        assert num_hit <= request.num_tokens - 1
        assert len({b.block_id for b in hits}) == len(hits)
        for i, block in enumerate(hits):
            expected = request.all_token_ids[i * bs : (i + 1) * bs]
            assert self.content[block.block_id] == expected, (block, expected)
            assert block.token_ids == tuple(expected)

    def _write(self, request: Request, start: int, end: int) -> None:
        blocks = self.kv.req_to_blocks[request.req_id]
        bs = self.BLOCK_SIZE
        for pos in range(start, end):
            block = blocks[pos // bs]
            token = request.all_token_ids[pos]
            assert block.ref_cnt == 1, f"write into shared {block}"
            if block.token_ids is not None:
                assert block.token_ids[pos % bs] == token
            if pos % bs == 0:
                self.content[block.block_id] = [None] * bs
            self.content[block.block_id][pos % bs] = token

    def _allocate(self, request: Request, num_new: int, hits: list[KVCacheBlock]) -> bool:
        before = snapshot(self.kv)
        free_before = self.kv.num_free_blocks
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        new = self.kv.allocate_slots(request, num_new, hits)
        event(f"allocate: {'short' if new is None else 'ok'}, hits from free: {num_free_hits > 0}")
        if new is None:
            assert snapshot(self.kv) == before
            return False
        for block in new:
            assert block.ref_cnt == 1
            assert block not in hits
        assert self.kv.num_free_blocks == free_before - len(new) - num_free_hits
        return True

    # -- rules

    @rule(prompt=PROMPTS)
    def add(self, prompt: list[int]) -> None:
        req_id = f"r{self.next_id}"
        self.next_id += 1
        self.pending[req_id] = make_request(req_id, prompt)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.pending)))
        request = self.pending[req_id]
        queries, hits_before = self.kv.num_prefix_queries, self.kv.num_prefix_hits
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert self.kv.num_prefix_queries == queries + request.num_tokens
        assert self.kv.num_prefix_hits == hits_before + num_hit
        self._check_hits(request, hits, num_hit)
        event(f"admit: {len(hits)} blocks hit")
        num_new = data.draw(st.integers(1, request.num_tokens - num_hit))
        if self._allocate(request, num_new, hits):
            assert self.kv.get_block_ids(req_id)[: len(hits)] == [b.block_id for b in hits]
            request.num_computed_tokens = num_hit + num_new
            self._write(request, num_hit, num_hit + num_new)
            self.live[req_id] = self.pending.pop(req_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 1))
    def extend(self, data: st.DataObject, token: int) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live[req_id]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)  # a decode step's new token
        start = request.num_computed_tokens
        num_new = data.draw(st.integers(1, request.num_tokens - start))
        if self._allocate(request, num_new, []):
            request.num_computed_tokens = start + num_new
            self._write(request, start, start + num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live.pop(req_id)
        blocks = list(self.kv.req_to_blocks[req_id])
        queue_before = queue_ids(self.kv)
        self.kv.free(request)
        assert req_id not in self.kv.req_to_blocks
        # Blocks reaching ref 0 join the tail, the request's tail block first.
        released = [b.block_id for b in reversed(blocks) if b.ref_cnt == 0]
        assert queue_ids(self.kv) == queue_before + released
        if preempt:
            request.num_computed_tokens = 0
            self.pending[req_id] = request

    @rule(prompt=PROMPTS)
    def lookup(self, prompt: list[int]) -> None:
        request = make_request("probe", prompt)
        before = snapshot(self.kv)
        hits, num_hit = self.kv.get_computed_blocks(request)
        self._check_hits(request, hits, num_hit)
        assert snapshot(self.kv) == before  # a lookup takes no reference

    # -- invariants

    @invariant()
    def pool_is_consistent(self) -> None:
        pool = self.kv.pool
        blocks = pool.blocks
        in_use = sum(1 for b in blocks if b.ref_cnt > 0)
        assert pool.num_free_blocks + in_use == self.NUM_BLOCKS
        queue = list(pool.free_queue)
        assert len(queue) == len(pool.free_queue)
        assert len({b.block_id for b in queue}) == len(queue)
        assert {b.block_id for b in queue} == {b.block_id for b in blocks if b.ref_cnt == 0}
        for block_hash, block in pool.cached.items():
            assert blocks[block.block_id] is block
            assert block.block_hash == block_hash
            assert block.token_ids is not None
            assert list(block.token_ids) == self.content[block.block_id]
        for block in blocks:
            if block.block_hash is not None:
                assert pool.cached[block.block_hash] is block

    @invariant()
    def ref_counts_match_live_requests(self) -> None:
        assert set(self.kv.req_to_blocks) == set(self.live)
        holders = [0] * self.NUM_BLOCKS
        for held in self.kv.req_to_blocks.values():
            assert len({b.block_id for b in held}) == len(held)
            for block in held:
                holders[block.block_id] += 1
        assert [b.ref_cnt for b in self.kv.pool.blocks] == holders

    @invariant()
    def held_blocks_counts_the_distinct_blocks_of_its_requests(self) -> None:
        lists = {r: b for r, b in self.kv.req_to_blocks.items() if int(r[1:]) % 2 == 0}
        distinct = {id(block) for blocks in lists.values() for block in blocks}
        assert self.held.count(lists) == len(distinct)

    @invariant()
    def live_requests_read_their_own_tokens(self) -> None:
        bs = self.BLOCK_SIZE
        for req_id, request in self.live.items():
            blocks = self.kv.req_to_blocks[req_id]
            assert len(blocks) == cdiv(request.num_computed_tokens, bs)
            for pos in range(request.num_computed_tokens):
                slot = self.content[blocks[pos // bs].block_id][pos % bs]
                assert slot == request.all_token_ids[pos]


KVCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_random_operations_keep_pool_consistent = KVCacheMachine.TestCase
