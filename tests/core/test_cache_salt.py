"""Prefix-cache isolation by salt (the gateway sends each key group's as `cache_salt`):
a group's cached prefix is never a hit for another group; within a group, and with no
salt at all, sharing is exactly as before."""

from __future__ import annotations

import msgspec

from tokenfleet.core.engine_api import EngineCoreRequest
from tokenfleet.core.kv_cache import ROOT_HASH, KVCacheManager, compute_block_hashes, root_hash
from tokenfleet.core.request import Request
from tokenfleet.core.sampling_params import SamplingParams

BLOCK = 4
PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks, the last token never a hit


def request(req_id: str, salt: str | None) -> Request:
    return Request(req_id, PROMPT, SamplingParams(), arrival_time=0.0, cache_salt=salt)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Schedule the whole prompt as the scheduler does; the tokens served from the cache."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def test_a_group_never_hits_another_groups_prefix_and_shares_its_own() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    assert admit(kv, request("a1", "group-a")) == 0
    assert admit(kv, request("b1", "group-b")) == 0  # the same tokens, another group
    assert admit(kv, request("n1", None)) == 0  # nor the unsalted requests
    assert admit(kv, request("a2", "group-a")) == 12  # three full blocks, within its group
    assert admit(kv, request("b2", "group-b")) == 12
    assert admit(kv, request("n2", None)) == 12
    # Each group holds its own copy of the three blocks, and so does the unsalted one.
    assert kv.pool.num_cached_blocks == 9


def test_no_salt_hashes_exactly_as_before() -> None:
    assert root_hash(None) == ROOT_HASH
    assert root_hash("") == ROOT_HASH
    assert compute_block_hashes(PROMPT, BLOCK) == compute_block_hashes(PROMPT, BLOCK, None, None)
    salted = compute_block_hashes(PROMPT, BLOCK, None, "group-a")
    assert len(salted) == 3
    assert not set(salted) & set(compute_block_hashes(PROMPT, BLOCK))
    assert not set(salted) & set(compute_block_hashes(PROMPT, BLOCK, None, "group-b"))
    # A digest of the salt, not hash(str): the same in every process.
    assert root_hash("group-a") == root_hash("group-a")


def test_cache_salt_crosses_the_wire_and_is_left_out_when_unset() -> None:
    params = SamplingParams(max_tokens=1)
    plain = EngineCoreRequest("r", PROMPT, params, 0.0)
    assert b"cache_salt" not in msgspec.msgpack.encode(plain)
    salted = EngineCoreRequest("r", PROMPT, params, 0.0, cache_salt="group-a")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(salted), type=EngineCoreRequest)
    assert back.cache_salt == "group-a"
