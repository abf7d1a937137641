"""Scheduler, driven step by step by the FakeModelRunner (tests/support/fake_runner.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.fake_runner import FakeModelRunner, TokenFn, fake_next_token, reference_generate

from tokenfleet.config import SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreOutput
from tokenfleet.core.kv_cache import KVCacheManager, cdiv
from tokenfleet.core.request import Request, RequestStatus
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.scheduler_output import ScheduledRequest, SchedulerOutput

# Every test here steps the scheduler with the FakeModelRunner (names test_fake_runner_...).
pytestmark = pytest.mark.fake("runner")

SP = SamplingParams()


@dataclass
class Harness:
    """A scheduler over a KV manager, stepped with a FakeModelRunner, checked every step."""

    scheduler: Scheduler
    runner: FakeModelRunner
    # req_id -> every token it was given, and its finish reason.
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    engine_outputs: list[list[EngineCoreOutput]] = field(default_factory=list)
    now: float = 0.0

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    def add(
        self,
        req_id: str,
        prompt: Sequence[int],
        *,
        max_tokens: int = 16,
        eos_token_id: int | None = None,
        **params: object,
    ) -> Request:
        self.now += 1.0  # arrival order = add order
        request = Request(
            req_id,
            list(prompt),
            SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
            arrival_time=self.now,
            eos_token_id=eos_token_id,
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        sched = self.scheduler
        running_before = [(r, r.num_tokens - r.num_computed_tokens) for r in sched.running]
        waiting_before = [r.req_id for r in sched.waiting]
        out = sched.schedule(self.now)
        check_schedule(sched, out, running_before, waiting_before)
        outputs = sched.update(out, self.runner.execute(out))
        for o in outputs:
            assert o.req_id not in self.finish_reasons, f"{o.req_id} reported after finishing"
            self.tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish_reasons[o.req_id] = o.finish_reason
        self.engine_outputs.append(outputs)
        check_state(sched)
        return out, outputs

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: {self.scheduler.requests}")

    def abort(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        outputs = self.scheduler.abort_requests(req_ids)
        for o in outputs:
            self.finish_reasons[o.req_id] = o.finish_reason or ""
        check_state(self.scheduler)
        return outputs

    def assert_all_free(self) -> None:
        pool = self.kv.pool
        assert pool.num_free_blocks == pool.num_blocks
        assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_blocks
        assert self.kv.req_to_blocks == {}
        assert self.scheduler.requests == {}
        assert self.scheduler.running == []
        assert list(self.scheduler.waiting) == []


def make_harness(
    *,
    num_blocks: int,
    block_size: int,
    budget: int,
    max_num_seqs: int = 16,
    max_model_len: int | None = None,
    caching: bool = True,
    token_fn: TokenFn = fake_next_token,
) -> Harness:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len or num_blocks * block_size,
    )
    return Harness(Scheduler(config, kv), FakeModelRunner(block_size, token_fn))


def check_schedule(
    sched: Scheduler,
    out: SchedulerOutput,
    running_before: list[tuple[Request, int]],
    waiting_before: list[str],
) -> None:
    """The step obeys the budget, the sequence cap and the running-first rule exactly."""
    config = sched.config
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    # The interactive reserve's count, kept up to date from the block lists, is the count
    # over every block (a shared block once).
    held = (sched.kv.req_to_blocks.get(r.req_id, ()) for r in sched.running if r.is_interactive)
    assert sched._num_interactive_blocks() == len({id(b) for blocks in held for b in blocks})
    assert len(out.scheduled) <= config.max_num_seqs
    assert len(sched.running) <= config.max_num_seqs
    counts = out.num_scheduled_tokens
    preempted = set(out.preempted_req_ids)
    # Running requests, in order, each get min(remaining, budget left); preempted get none.
    budget = config.max_num_batched_tokens
    for request, remaining in running_before:
        if request.req_id in preempted:
            assert request.req_id not in counts
            assert request.status == RequestStatus.PREEMPTED
            assert request.num_computed_tokens == 0
            continue
        if budget == 0:
            assert request.req_id not in counts
            continue
        assert counts[request.req_id] == min(remaining, budget), (request, counts)
        budget -= counts[request.req_id]
    # Waiting requests: only from the front of the queue, only with budget left, and
    # never in a step that preempted.
    running_ids = {r.req_id for r, _ in running_before}
    admitted = [s.req_id for s in out.scheduled if s.req_id not in running_ids]
    assert admitted == waiting_before[: len(admitted)]
    if admitted:
        assert not preempted
        assert budget > 0
    # Preempted requests are at the front of the waiting queue, newest first.
    assert [r.req_id for r in list(sched.waiting)[: len(preempted)]] == list(
        reversed(out.preempted_req_ids)
    )
    # The scheduled requests come in running order.
    assert [s.req_id for s in out.scheduled] == [
        r.req_id for r in sched.running if r.req_id in counts
    ]
    for s in out.scheduled:
        request = sched.requests[s.req_id]
        assert s.start_pos + s.num_tokens == request.num_computed_tokens
        assert s.token_ids == request.all_token_ids[s.start_pos : request.num_computed_tokens]
        # Only what changed: the blocks taken since its previous step, all of them when it
        # is new to the runner (the FakeModelRunner reads its tables kept from these).
        held = sched.kv.get_block_ids(s.req_id)
        assert s.new_block_ids == (
            held if s.new_table else held[len(held) - len(s.new_block_ids) :]
        )
        assert s.sample == (request.num_computed_tokens == request.num_tokens)
        assert s.sampling_params is request.sampling_params


def check_state(sched: Scheduler) -> None:
    """Between steps: every block is held by exactly the requests that list it."""
    kv = sched.kv
    pool = kv.pool
    running = {r.req_id for r in sched.running}
    waiting = {r.req_id for r in sched.waiting}
    assert len(running) == len(sched.running)
    assert len(waiting) == len(sched.waiting)
    assert not running & waiting
    assert running | waiting == set(sched.requests)
    assert set(kv.req_to_blocks) == running
    holders = [0] * pool.num_blocks
    for req_id, blocks in kv.req_to_blocks.items():
        request = sched.requests[req_id]
        assert request.status == RequestStatus.RUNNING
        assert len(blocks) == cdiv(request.num_computed_tokens, kv.block_size)
        for block in blocks:
            holders[block.block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == holders
    assert {b.block_id for b in pool.free_queue} == {i for i, n in enumerate(holders) if n == 0}
    for request in sched.waiting:
        assert request.num_computed_tokens == 0
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def sr(
    req_id: str, token_ids: list[int], start_pos: int, block_ids: list[int], sample: bool
) -> tuple[str, list[int], int, list[int], bool]:
    return (req_id, token_ids, start_pos, block_ids, sample)


def plain(
    out: SchedulerOutput, runner: FakeModelRunner
) -> list[tuple[str, list[int], int, list[int], bool]]:
    """The step's rows, each with its whole block table as `runner` keeps it after the step."""
    tables = runner.block_tables
    return [
        (s.req_id, s.token_ids, s.start_pos, tables.block_ids(s.req_id), s.sample)
        for s in out.scheduled
    ]


def position_token(req_id: str, context: Sequence[int]) -> int:
    """The token sampled after `context` is 100 + its position."""
    return 100 + len(context)


# -- one small scenario, every SchedulerOutput exact ------------------------------------


def test_fake_runner_exact_scheduler_outputs_two_requests() -> None:
    h = make_harness(num_blocks=8, block_size=4, budget=6, token_fn=position_token)
    h.add("a", [1, 2, 3, 4, 5], max_tokens=3)
    h.add("b", [1, 2, 3, 4, 11, 12, 13], max_tokens=3)  # shares a's first block

    # Step 1: a's whole prompt (5), then b: block 0 is a prefix hit (cached as a
    # allocated it), so b starts at position 4 and gets the 1 token left in the budget.
    out, outputs = h.step()
    assert plain(out, h.runner) == [
        sr("a", [1, 2, 3, 4, 5], 0, [0, 1], True),
        sr("b", [11], 4, [0, 2], False),
    ]
    assert out.finished_req_ids == frozenset()
    assert out.preempted_req_ids == ()
    assert outputs == [EngineCoreOutput("a", [105], num_cached_tokens=0)]
    assert h.scheduler.requests["b"].num_cached_tokens == 4
    assert h.kv.pool.blocks[0].ref_cnt == 2

    # Step 2: a decodes (running first), b finishes its prompt.
    out, outputs = h.step()
    assert plain(out, h.runner) == [
        sr("a", [105], 5, [0, 1], True),
        sr("b", [12, 13], 5, [0, 2], True),
    ]
    assert outputs == [
        EngineCoreOutput("a", [106], num_cached_tokens=0),
        EngineCoreOutput("b", [107], num_cached_tokens=4),
    ]

    # Step 3: both decode; a reaches max_tokens.
    out, outputs = h.step()
    assert plain(out, h.runner) == [
        sr("a", [106], 6, [0, 1], True),
        sr("b", [107], 7, [0, 2], True),
    ]
    assert outputs == [
        EngineCoreOutput("a", [107], finish_reason="length", num_cached_tokens=0),
        EngineCoreOutput("b", [108], num_cached_tokens=4),
    ]
    # a's block 1 went back to the free queue; block 0 is still b's.
    assert h.kv.pool.blocks[0].ref_cnt == 1
    assert [b.block_id for b in h.kv.pool.free_queue] == [3, 4, 5, 6, 7, 1]

    # Step 4: b's 9th token needs a third block: the head of the free queue, block 3.
    out, outputs = h.step()
    assert out.finished_req_ids == frozenset({"a"})
    assert plain(out, h.runner) == [sr("b", [108], 8, [0, 2, 3], True)]
    assert outputs == [EngineCoreOutput("b", [109], finish_reason="length", num_cached_tokens=4)]

    # Step 5: nothing to run; b's finish is reported once.
    assert not h.scheduler.has_unfinished_requests()
    out, outputs = h.step()
    assert out.scheduled == []
    assert out.finished_req_ids == frozenset({"b"})
    assert outputs == []
    out, _ = h.step()
    assert out.finished_req_ids == frozenset()

    assert h.runner.num_scheduled_tokens == [
        {"a": 5, "b": 1},
        {"a": 1, "b": 2},
        {"a": 1, "b": 1},
        {"b": 1},
        {},
        {},
    ]
    h.assert_all_free()
    # Full blocks fed to the model stay cached: a's [1,2,3,4] and b's [11,12,13,107].
    assert {b.block_id for b in h.kv.pool.cached.values()} == {0, 2}
    assert (h.kv.num_prefix_queries, h.kv.num_prefix_hits) == (12, 4)
    assert h.scheduler.num_steps == 6


def test_fake_runner_scheduled_request_fields() -> None:
    h = make_harness(num_blocks=4, block_size=4, budget=8)
    params = SamplingParams(max_tokens=2, temperature=0.5)
    request = Request("a", [1, 2, 3], params, arrival_time=0.0)
    h.scheduler.add_request(request)
    out, _ = h.step()
    assert out.scheduled == [
        ScheduledRequest(
            req_id="a",
            token_ids=[1, 2, 3],
            start_pos=0,
            new_block_ids=[0],
            new_table=True,
            sample=True,
            sampling_params=params,
        )
    ]
    with pytest.raises(ValueError, match="already in the scheduler"):
        h.scheduler.add_request(Request("a", [1], params, arrival_time=0.0))


# -- budget, max_num_seqs, running first, chunked prefill -------------------------------


def test_fake_runner_long_prompt_is_chunked_and_never_stalls_decodes() -> None:
    h = make_harness(num_blocks=16, block_size=4, budget=8)
    h.add("short", [1, 2, 3], max_tokens=9)
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"short": 3}
    long_prompt = list(range(10, 50))  # 40 tokens
    h.add("long", long_prompt, max_tokens=2)
    starts = []
    for _ in range(6):
        out, _ = h.step()
        starts.append([(s.req_id, s.start_pos, s.sample) for s in out.scheduled])
    # 'short' decodes 1 token every step while 'long' takes the rest: 7 x 5 + 5.
    assert h.runner.num_scheduled_tokens == [
        {"short": 3},
        {"short": 1, "long": 7},
        {"short": 1, "long": 7},
        {"short": 1, "long": 7},
        {"short": 1, "long": 7},
        {"short": 1, "long": 7},
        {"short": 1, "long": 5},
    ]
    assert [s[1] for s in starts] == [
        ("long", 0, False),
        ("long", 7, False),
        ("long", 14, False),
        ("long", 21, False),
        ("long", 28, False),
        ("long", 35, True),
    ]
    h.run()
    assert h.runner.num_scheduled_tokens[7:] == [{"short": 1, "long": 1}, {"short": 1}]
    assert h.tokens == {
        "short": reference_generate([1, 2, 3], 9),
        "long": reference_generate(long_prompt, 2),
    }
    assert h.finish_reasons == {"short": "length", "long": "length"}
    h.assert_all_free()


def test_fake_runner_running_requests_served_before_waiting() -> None:
    h = make_harness(num_blocks=16, block_size=4, budget=2)
    h.add("a", [1], max_tokens=3)
    h.add("b", [2], max_tokens=3)
    h.add("c", [3], max_tokens=1)
    for _ in range(3):
        h.step()
        assert h.scheduler.requests["c"].status == RequestStatus.WAITING
    h.run()
    assert h.runner.num_scheduled_tokens == [
        {"a": 1, "b": 1},
        {"a": 1, "b": 1},
        {"a": 1, "b": 1},
        {"c": 1},
    ]
    assert h.tokens == {
        "a": reference_generate([1], 3),
        "b": reference_generate([2], 3),
        "c": reference_generate([3], 1),
    }


def test_fake_runner_waiting_prompt_gets_what_decodes_leave() -> None:
    h = make_harness(num_blocks=16, block_size=4, budget=4)
    h.add("a", [1, 2], max_tokens=4)
    h.add("b", [3, 4], max_tokens=4)
    h.step()
    h.add("c", [5, 6, 7, 8, 9], max_tokens=1)
    h.run()
    assert h.runner.num_scheduled_tokens == [
        {"a": 2, "b": 2},
        {"a": 1, "b": 1, "c": 2},
        {"a": 1, "b": 1, "c": 2},
        {"a": 1, "b": 1, "c": 1},
    ]
    assert h.finish_reasons == {"a": "length", "b": "length", "c": "length"}


def test_fake_runner_max_num_seqs_caps_running_requests() -> None:
    h = make_harness(num_blocks=16, block_size=4, budget=100, max_num_seqs=2)
    h.add("a", [1, 2], max_tokens=2)
    h.add("b", [3], max_tokens=3)
    h.add("c", [4, 5, 6], max_tokens=1)
    h.run()
    assert h.runner.num_scheduled_tokens == [
        {"a": 2, "b": 1},
        {"a": 1, "b": 1},  # a finishes
        {"b": 1, "c": 3},  # b finishes, c finishes
    ]
    assert h.tokens == {
        "a": reference_generate([1, 2], 2),
        "b": reference_generate([3], 3),
        "c": reference_generate([4, 5, 6], 1),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 4),
    extra_blocks=st.integers(0, 3),
    caching=st.booleans(),
    requests=st.lists(
        st.tuples(
            # prompts from a 2-token alphabet with shared prefixes, so prefix hits happen
            st.sampled_from([[], [0, 1, 0, 1], [0, 1, 0, 1, 1, 1, 0, 0]]),
            st.lists(st.integers(0, 1), max_size=14),
            st.integers(1, 6),  # max_tokens
            st.integers(0, 6),  # step at which it arrives
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_fake_runner_random_workloads_respect_limits_and_match_reference(
    block_size: int,
    budget: int,
    max_num_seqs: int,
    extra_blocks: int,
    caching: bool,
    requests: list[tuple[list[int], list[int], int, int]],
) -> None:
    prompts = [(prefix + suffix) or [0] for prefix, suffix, _, _ in requests]
    # Every request fits the cache on its own (as EngineCore guarantees via max_model_len).
    longest = max(
        len(p) + max_tokens for p, (_, _, max_tokens, _) in zip(prompts, requests, strict=True)
    )
    num_blocks = cdiv(longest, block_size) + extra_blocks
    h = make_harness(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=budget,
        max_num_seqs=max_num_seqs,
        caching=caching,
    )
    arrivals = sorted(range(len(requests)), key=lambda i: requests[i][3])
    expected = {}
    step = 0
    pending = list(arrivals)
    while pending or h.scheduler.has_unfinished_requests():
        while pending and requests[pending[0]][3] <= step:
            i = pending.pop(0)
            req_id = f"r{i}"
            h.add(req_id, prompts[i], max_tokens=requests[i][2])
            expected[req_id] = reference_generate(prompts[i], requests[i][2])
        h.step()
        step += 1
        assert step < 1000, "livelock"
    assert h.tokens == expected
    assert h.finish_reasons == dict.fromkeys(expected, "length")
    h.assert_all_free()
    event(f"preemptions: {min(h.scheduler.num_preemptions, 3)}")
    event(f"prefix hits: {h.kv.num_prefix_hits > 0}")


# -- preemption ----------------------------------------------------------------------


def test_fake_runner_preempts_newest_and_rehits_its_cached_prefix() -> None:
    h = make_harness(num_blocks=5, block_size=2, budget=100)
    h.add("a", [1, 2, 3, 4], max_tokens=2)
    b = h.add("b", [5, 6, 7, 8], max_tokens=2)
    out, _ = h.step()
    assert plain(out, h.runner) == [
        sr("a", [1, 2, 3, 4], 0, [0, 1], True),
        sr("b", [5, 6, 7, 8], 0, [2, 3], True),
    ]
    assert h.kv.num_free_blocks == 1
    b_first = h.tokens["b"][0]

    # a's 5th token takes the last free block; b (the newest) needs one too: preempted.
    out, _ = h.step()
    assert out.preempted_req_ids == ("b",)
    assert plain(out, h.runner) == [sr("a", [h.tokens["a"][0]], 4, [0, 1, 4], True)]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert h.scheduler.num_preemptions == 1
    assert [r.req_id for r in h.scheduler.waiting] == ["b"]
    assert "b" not in h.kv.req_to_blocks
    assert h.finish_reasons == {"a": "length"}  # a finished in this step's update
    # b's freed blocks, tail first, are still cached.
    assert h.kv.pool.blocks[2].block_hash == b.block_hashes[0]
    assert h.kv.pool.blocks[3].block_hash == b.block_hashes[1]

    # b comes back: both full prompt blocks hit, only its sampled token is recomputed.
    queries, hits = h.kv.num_prefix_queries, h.kv.num_prefix_hits
    out, _ = h.step()
    assert out.finished_req_ids == frozenset({"a"})
    assert out.preempted_req_ids == ()
    assert plain(out, h.runner) == [sr("b", [b_first], 4, [2, 3, 4], True)]
    assert h.kv.num_prefix_queries - queries == 5
    assert h.kv.num_prefix_hits - hits == 4
    assert b.num_cached_tokens == 0  # the usage figure is from its first admission

    h.run()
    assert h.tokens == {
        "a": reference_generate([1, 2, 3, 4], 2),
        "b": reference_generate([5, 6, 7, 8], 2),
    }
    assert h.finish_reasons == {"a": "length", "b": "length"}
    assert b.num_preemptions == 1
    h.assert_all_free()


def test_fake_runner_preemption_victim_is_newest_not_current() -> None:
    h = make_harness(num_blocks=4, block_size=2, budget=100, max_num_seqs=3)
    h.add("a", [1, 2], max_tokens=2)
    h.add("b", [3, 4], max_tokens=2)
    c = h.add("c", [5, 6], max_tokens=2)
    h.add("d", [7, 8], max_tokens=2)  # over max_num_seqs: waits
    out, _ = h.step()
    assert plain(out, h.runner) == [
        sr("a", [1, 2], 0, [0], True),
        sr("b", [3, 4], 0, [1], True),
        sr("c", [5, 6], 0, [2], True),
    ]
    # a takes block 3; b needs a block: c (newest running) is preempted for it, and goes
    # to the front of the waiting queue, ahead of d.
    out, _ = h.step()
    assert out.preempted_req_ids == ("c",)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [h.runner.block_tables.block_ids(s.req_id) for s in out.scheduled] == [[0, 3], [1, 2]]
    assert [(s.new_block_ids, s.new_table) for s in out.scheduled] == [([3], False), ([2], False)]
    assert [r.req_id for r in h.scheduler.waiting] == ["c", "d"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert h.scheduler.num_preemptions == 1
    h.run()
    # c's only full block was reallocated to b, so c recomputes all 3 of its tokens.
    assert h.runner.num_scheduled_tokens[2] == {"c": 3, "d": 2}
    assert h.tokens == {
        "a": reference_generate([1, 2], 2),
        "b": reference_generate([3, 4], 2),
        "c": reference_generate([5, 6], 2),
        "d": reference_generate([7, 8], 2),
    }
    h.assert_all_free()


def test_fake_runner_preempted_mid_prefill_resumes_from_cache() -> None:
    h = make_harness(num_blocks=6, block_size=2, budget=4)
    h.add("a", [1, 2], max_tokens=4)
    prompt = list(range(10, 20))
    b = h.add("b", prompt, max_tokens=1)
    h.step()
    h.step()
    h.step()
    assert h.runner.num_scheduled_tokens == [{"a": 2, "b": 2}, {"a": 1, "b": 3}, {"a": 1, "b": 3}]
    assert h.kv.get_block_ids("b") == [1, 3, 4, 5]
    assert b.num_computed_tokens == 8
    assert h.kv.num_free_blocks == 0
    # a's 5th token needs a block: b, 8 of 10 prompt tokens in, is preempted; a takes the
    # head of the free queue, b's tail block 5 ([16, 17]).
    out, _ = h.step()
    assert out.preempted_req_ids == ("b",)
    assert plain(out, h.runner) == [sr("a", [h.tokens["a"][2]], 4, [0, 2, 5], True)]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert h.finish_reasons == {"a": "length"}
    # b resumes: [10, 11], [12, 13], [14, 15] hit; [16, 17] was evicted and is recomputed.
    queries, hits = h.kv.num_prefix_queries, h.kv.num_prefix_hits
    out, _ = h.step()
    assert plain(out, h.runner) == [sr("b", [16, 17, 18, 19], 6, [1, 3, 4, 5, 2], True)]
    assert (h.kv.num_prefix_queries - queries, h.kv.num_prefix_hits - hits) == (10, 6)
    assert h.finish_reasons == {"a": "length", "b": "length"}
    assert h.tokens == {
        "a": reference_generate([1, 2], 4),
        "b": reference_generate(prompt, 1),
    }
    assert h.scheduler.num_preemptions == 1
    h.run()
    h.assert_all_free()


# -- abort ---------------------------------------------------------------------------


ABORT = [EngineCoreOutput("x", [], finish_reason="abort")]


def test_fake_runner_abort_waiting() -> None:
    h = make_harness(num_blocks=8, block_size=2, budget=16, max_num_seqs=1)
    h.add("a", [1, 2, 3], max_tokens=5)
    h.add("x", [4, 5, 6], max_tokens=5)
    h.step()
    assert h.scheduler.requests["x"].status == RequestStatus.WAITING
    assert h.abort(["x"]) == ABORT
    assert [r.req_id for r in h.scheduler.waiting] == []
    out, _ = h.step()
    assert out.finished_req_ids == frozenset({"x"})
    h.run()
    assert h.tokens == {"a": reference_generate([1, 2, 3], 5)}
    h.assert_all_free()


def test_fake_runner_abort_mid_prefill() -> None:
    h = make_harness(num_blocks=8, block_size=2, budget=4)
    x = h.add("x", list(range(10)), max_tokens=5)
    out, outputs = h.step()
    assert plain(out, h.runner) == [sr("x", [0, 1, 2, 3], 0, [0, 1], False)]
    assert outputs == []
    assert x.status == RequestStatus.RUNNING
    assert x.num_computed_tokens == 4
    assert h.abort(["x"]) == ABORT
    assert x.status.finish_reason == "abort"  # FINISHED_ABORTED
    h.assert_all_free()
    out, _ = h.step()
    assert out.finished_req_ids == frozenset({"x"})
    assert out.scheduled == []
    out, _ = h.step()
    assert out.finished_req_ids == frozenset()


def test_fake_runner_abort_decoding() -> None:
    h = make_harness(num_blocks=8, block_size=2, budget=16)
    x = h.add("x", [1, 2, 3], max_tokens=10)
    h.add("y", [1, 2, 7], max_tokens=3)  # shares x's first block
    h.step()
    h.step()
    assert x.num_output_tokens == 2
    assert h.kv.pool.blocks[0].ref_cnt == 2
    assert h.abort(["x"]) == ABORT
    assert h.kv.pool.blocks[0].ref_cnt == 1  # still y's
    assert "x" not in h.kv.req_to_blocks
    out, _ = h.step()
    assert out.finished_req_ids == frozenset({"x"})
    assert out.num_scheduled_tokens == {"y": 1}
    h.run()
    assert h.tokens["x"] == reference_generate([1, 2, 3], 2)
    assert h.tokens["y"] == reference_generate([1, 2, 7], 3)
    assert h.finish_reasons == {"x": "abort", "y": "length"}
    h.assert_all_free()


def test_fake_runner_abort_preempted() -> None:
    h = make_harness(num_blocks=5, block_size=2, budget=100)
    h.add("a", [1, 2, 3, 4], max_tokens=4)
    x = h.add("x", [5, 6, 7, 8], max_tokens=4)
    h.step()
    out, _ = h.step()
    assert out.preempted_req_ids == ("x",)
    assert x.status == RequestStatus.PREEMPTED
    assert h.abort(["x"]) == ABORT
    assert list(h.scheduler.waiting) == []
    out, _ = h.step()
    assert out.finished_req_ids == frozenset({"x"})
    h.run()
    assert h.tokens["a"] == reference_generate([1, 2, 3, 4], 4)
    assert h.finish_reasons == {"a": "length", "x": "abort"}
    h.assert_all_free()


def test_fake_runner_abort_while_step_in_flight_drops_its_token() -> None:
    h = make_harness(num_blocks=8, block_size=2, budget=16)
    h.add("x", [1, 2, 3], max_tokens=4)
    out = h.scheduler.schedule(0.0)
    runner_output = h.runner.execute(out)
    assert list(runner_output.sampled_token_ids) == ["x"]
    assert h.scheduler.abort_requests(["x"]) == ABORT
    assert h.scheduler.update(out, runner_output) == []
    h.assert_all_free()


def test_fake_runner_abort_unknown_or_finished_is_ignored() -> None:
    h = make_harness(num_blocks=8, block_size=2, budget=16)
    h.add("x", [1, 2, 3], max_tokens=1)
    h.run()
    assert h.abort(["x", "nope"]) == []
    out, _ = h.step()
    assert out.finished_req_ids == frozenset({"x"})
    h.assert_all_free()


def test_fake_runner_abort_everything_at_every_stage_at_once() -> None:
    h = make_harness(num_blocks=6, block_size=2, budget=5, max_num_seqs=3)
    h.add("decoding", [1, 2], max_tokens=20)
    h.add("prefill", list(range(10, 20)), max_tokens=5)
    h.step()  # decoding: 2, prefill: 3
    h.step()  # decoding: 1, prefill: 4
    h.add("waiting", [3, 4], max_tokens=2)
    h.step()  # decoding: 1 -> needs block 2: prefill preempted
    stages = {r.req_id: r.status for r in h.scheduler.requests.values()}
    assert stages == {
        "decoding": RequestStatus.RUNNING,
        "prefill": RequestStatus.PREEMPTED,
        "waiting": RequestStatus.WAITING,
    }
    outputs = h.abort(["waiting", "prefill", "decoding"])
    assert outputs == [
        EngineCoreOutput(req_id, [], finish_reason="abort")
        for req_id in ("waiting", "prefill", "decoding")
    ]
    h.assert_all_free()
    out, _ = h.step()
    assert out.finished_req_ids == frozenset({"waiting", "prefill", "decoding"})


# -- stop conditions -----------------------------------------------------------------


def tokens_at(positions: dict[int, int]) -> TokenFn:
    """Sample positions[len(context)] when given, else 500."""
    return lambda req_id, context: positions.get(len(context), 500)


def finish(h: Harness, req_id: str) -> tuple[list[int], str, int | None]:
    h.run()
    last = next(o for outs in reversed(h.engine_outputs) for o in outs if o.req_id == req_id)
    return h.tokens[req_id], h.finish_reasons[req_id], last.stop_token_id


def test_fake_runner_stops_at_eos() -> None:
    h = make_harness(num_blocks=8, block_size=4, budget=16, token_fn=tokens_at({5: 7}))
    h.add("a", [1, 2, 3], max_tokens=10, eos_token_id=7)
    assert finish(h, "a") == ([500, 500, 7], "stop", 7)
    h.assert_all_free()


def test_fake_runner_ignore_eos_runs_to_max_tokens() -> None:
    h = make_harness(num_blocks=8, block_size=4, budget=16, token_fn=tokens_at({5: 7}))
    h.add("a", [1, 2, 3], max_tokens=5, eos_token_id=7, ignore_eos=True)
    assert finish(h, "a") == ([500, 500, 7, 500, 500], "length", None)


def test_fake_runner_no_eos_token_id_never_stops_on_it() -> None:
    h = make_harness(num_blocks=8, block_size=4, budget=16, token_fn=tokens_at({5: 7}))
    h.add("a", [1, 2, 3], max_tokens=4)
    assert finish(h, "a") == ([500, 500, 7, 500], "length", None)


def test_fake_runner_stops_at_stop_token_ids_even_with_ignore_eos() -> None:
    h = make_harness(num_blocks=8, block_size=4, budget=16, token_fn=tokens_at({4: 9, 5: 7}))
    h.add("a", [1, 2, 3], max_tokens=10, eos_token_id=7, ignore_eos=True, stop_token_ids=(8, 9))
    assert finish(h, "a") == ([500, 9], "stop", 9)


def test_fake_runner_stops_at_max_tokens() -> None:
    h = make_harness(num_blocks=8, block_size=4, budget=16)
    h.add("a", [1, 2, 3], max_tokens=6)
    assert finish(h, "a") == (reference_generate([1, 2, 3], 6), "length", None)
    assert h.runner.num_scheduled_tokens == [{"a": 3}] + [{"a": 1}] * 5


def test_fake_runner_stops_at_max_model_len() -> None:
    h = make_harness(num_blocks=8, block_size=4, budget=16, max_model_len=10)
    h.add("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=100)
    assert finish(h, "a") == (reference_generate([1, 2, 3, 4, 5, 6, 7], 3), "length", None)
    # The 10th token is sampled but never fed back.
    assert h.runner.num_scheduled_tokens == [{"a": 7}, {"a": 1}, {"a": 1}]


def test_fake_runner_finished_ids_reported_once_in_next_output() -> None:
    h = make_harness(num_blocks=8, block_size=4, budget=16)
    h.add("a", [1], max_tokens=1)
    h.add("b", [2], max_tokens=2)
    outs = [h.step()[0] for _ in range(4)]
    assert [o.finished_req_ids for o in outs] == [
        frozenset(),
        frozenset({"a"}),
        frozenset({"b"}),
        frozenset(),
    ]
    assert [o.num_scheduled_tokens for o in outs] == [{"a": 1, "b": 1}, {"b": 1}, {}, {}]
