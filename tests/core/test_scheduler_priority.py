"""Priority classes in the scheduler: admission, token budget, preemption, the harvest
budget and the interactive reserve, driven step by step by the FakeModelRunner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.fake_runner import FakeModelRunner, reference_generate
from test_scheduler import check_state, plain, sr

from tokenfleet.config import SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreOutput
from tokenfleet.core.kv_cache import KVCacheManager, cdiv
from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE, Request, RequestStatus
from tokenfleet.core.request_queue import PriorityRequestQueue
from tokenfleet.core.reserve import InteractiveReserve
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.scheduler_output import SchedulerOutput

INTERACTIVE, BATCH = PRIORITY_INTERACTIVE, PRIORITY_BATCH


@dataclass
class Run:
    """A scheduler with priority classes over a FakeModelRunner; every step is checked.

    `now` is the injected clock: each add moves it on by 1 s (arrival order = add order),
    and tests move it on by hand for the reserve's window.
    """

    scheduler: Scheduler
    runner: FakeModelRunner
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    now: float = 0.0

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    def add(self, req_id: str, prompt: Sequence[int], priority: int, max_tokens: int) -> Request:
        self.now += 1.0
        request = Request(
            req_id,
            list(prompt),
            SamplingParams(max_tokens=max_tokens),
            arrival_time=self.now,
            priority=priority,
        )
        self.scheduler.add_request(request)
        return request

    def step(self, batch_token_budget: int | None = None) -> SchedulerOutput:
        sched = self.scheduler
        before = Before(
            running=[(r, r.num_tokens - r.num_computed_tokens) for r in sched.running],
            waiting=list(sched.waiting),
        )
        out = sched.schedule(self.now, batch_token_budget=batch_token_budget)
        check_priority_schedule(sched, out, before, batch_token_budget)
        self.record(sched.update(out, self.runner.execute(out)))
        check_state(sched)
        return out

    def record(self, outputs: list[EngineCoreOutput]) -> None:
        for o in outputs:
            assert o.req_id not in self.finish_reasons
            self.tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish_reasons[o.req_id] = o.finish_reason

    def run(self) -> None:
        """Step until every request has finished."""
        for _ in range(500):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"livelock: {self.scheduler.requests}")

    def blocks(self, req_id: str) -> list[int]:
        return self.kv.get_block_ids(req_id)


def make_run(
    *,
    num_blocks: int,
    block_size: int = 2,
    budget: int = 100,
    max_num_seqs: int = 16,
    caching: bool = True,
    reserve_max_fraction: float = 0.0,
    reserve_min_blocks: int = 0,
    reserve_margin: float = 1.0,
    reserve_window_s: float = 10.0,
    long_prefill_threshold: int = 0,
) -> Run:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=num_blocks * block_size,
        interactive_reserve_window_s=reserve_window_s,
        interactive_reserve_margin=reserve_margin,
        interactive_reserve_min_blocks=reserve_min_blocks,
        interactive_reserve_max_fraction=reserve_max_fraction,
        long_prefill_token_threshold=long_prefill_threshold,
    )
    return Run(Scheduler(config, kv), FakeModelRunner(block_size))


@dataclass
class Before:
    running: list[tuple[Request, int]]  # with the tokens each had left
    waiting: list[Request]


def check_priority_schedule(
    sched: Scheduler, out: SchedulerOutput, before: Before, batch_token_budget: int | None
) -> None:
    """The class rules every step obeys, whatever the workload."""
    config = sched.config
    counts = out.num_scheduled_tokens
    priority = {r.req_id: r.priority for r in [*sched.running, *sched.waiting]}
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(sched.running) <= config.max_num_seqs
    batch_tokens = sum(n for req_id, n in counts.items() if priority[req_id] != INTERACTIVE)
    assert batch_tokens <= (batch_token_budget if batch_token_budget is not None else 10**9)
    # Class order, and running sorted by class.
    assert [priority[s.req_id] for s in out.scheduled] == sorted(
        priority[s.req_id] for s in out.scheduled
    )
    assert [r.priority for r in sched.running] == sorted(r.priority for r in sched.running)
    # Running interactive requests come first and in order: each gets min(left, budget),
    # but a prompt with interactive requests waiting gets at least min(left, threshold,
    # budget), and more only what the waiting ones left of the step's budget.
    preempted = [sched.requests[req_id] for req_id in out.preempted_req_ids]
    budget = config.max_num_batched_tokens
    threshold = config.long_prefill_token_threshold
    cut = bool(threshold) and any(r.priority == INTERACTIVE for r in before.waiting)
    for request, left in before.running:
        if request.priority != INTERACTIVE or request in preempted:
            continue
        got = counts.get(request.req_id, 0)
        if cut and left > 1 and min(left, budget) > threshold:
            assert threshold <= got <= min(left, budget)
            budget -= threshold
        else:
            assert got == min(left, budget)
            budget -= got
    # Admission: from the front of the queue (the most urgent class first), never a class
    # that lost a request to preemption in this step.
    running_ids = {r.req_id for r, _ in before.running}
    admitted = [s.req_id for s in out.scheduled if s.req_id not in running_ids]
    assert admitted == [r.req_id for r in before.waiting[: len(admitted)]]
    assert not {priority[a] for a in admitted} & {r.priority for r in preempted}
    # Victims: least urgent class first, newest within it; back at the front of their
    # class's queue, the last preempted first.
    assert [(r.priority, r.arrival_time) for r in preempted] == sorted(
        ((r.priority, r.arrival_time) for r in preempted), reverse=True
    )
    for request in preempted:
        assert request.status == RequestStatus.PREEMPTED and request.req_id not in counts
    for p in {r.priority for r in preempted}:
        same_class = [r for r in sched.waiting if r.priority == p]
        victims = [r for r in reversed(preempted) if r.priority == p]
        assert same_class[: len(victims)] == victims
    # An interactive request is preempted only when no batch request is left running.
    if any(r.priority == INTERACTIVE for r in preempted):
        assert all(r.priority == INTERACTIVE for r in sched.running)


def scheduled_counts(run: Run) -> list[dict[str, int]]:
    return run.runner.num_scheduled_tokens


# -- admission and the token budget --------------------------------------------------


@pytest.mark.fake("runner")
def test_fake_runner_interactive_admitted_and_served_before_an_earlier_batch_request() -> None:
    run = make_run(num_blocks=16, budget=4)
    run.add("b", [1, 2, 3, 4, 5, 6], BATCH, max_tokens=2)
    run.add("i", [7, 8, 9], INTERACTIVE, max_tokens=3)
    assert [r.req_id for r in run.scheduler.waiting] == ["i", "b"]
    run.run()
    assert scheduled_counts(run) == [
        {"i": 3, "b": 1},  # i's whole prompt, b gets what is left
        {"i": 1, "b": 3},
        {"i": 1, "b": 2},  # i finishes
        {"b": 1},
    ]
    assert run.tokens == {
        "i": reference_generate([7, 8, 9], 3),
        "b": reference_generate([1, 2, 3, 4, 5, 6], 2),
    }


@pytest.mark.fake("runner")
def test_fake_runner_waiting_interactive_prompt_goes_before_running_batch_decodes() -> None:
    run = make_run(num_blocks=16, budget=4)
    run.add("b1", [1, 2], BATCH, max_tokens=6)
    run.add("b2", [3], BATCH, max_tokens=6)
    run.step()
    assert scheduled_counts(run) == [{"b1": 2, "b2": 1}]
    run.add("i", list(range(10, 20)), INTERACTIVE, max_tokens=2)
    for _ in range(4):
        run.step()
    # i's 10-token prompt takes the whole budget for two steps; batch gets the rest.
    assert scheduled_counts(run)[1:] == [
        {"i": 4},
        {"i": 4},
        {"i": 2, "b1": 1, "b2": 1},
        {"i": 1, "b1": 1, "b2": 1},  # i finishes
    ]
    out = run.step()
    assert out.num_scheduled_tokens == {"b1": 1, "b2": 1}
    run.run()
    assert run.tokens["i"] == reference_generate(list(range(10, 20)), 2)
    assert run.tokens["b1"] == reference_generate([1, 2], 6)
    assert run.tokens["b2"] == reference_generate([3], 6)
    assert run.scheduler.num_preemptions == 0


@pytest.mark.fake("runner")
def test_fake_runner_step_order_interactive_then_batch_each_running_then_waiting() -> None:
    run = make_run(num_blocks=32, budget=3)
    run.add("b1", [1], BATCH, max_tokens=4)
    run.step()
    run.add("i1", [2], INTERACTIVE, max_tokens=4)
    run.add("b2", [3, 4, 5], BATCH, max_tokens=1)
    run.add("i2", [6], INTERACTIVE, max_tokens=4)
    run.step()
    run.step()
    assert scheduled_counts(run) == [
        {"b1": 1},
        {"i1": 1, "i2": 1, "b1": 1},  # waiting interactive before running batch
        {"i1": 1, "i2": 1, "b1": 1},  # b2 waits: the budget is spent
    ]
    # Running order: interactive (in admission order), then batch.
    assert [r.req_id for r in run.scheduler.running] == ["i1", "i2", "b1"]
    run.run()
    assert scheduled_counts(run)[3:] == [
        {"i1": 1, "i2": 1, "b1": 1},  # b1 finishes
        {"i1": 1, "i2": 1, "b2": 1},  # i1 and i2 finish; b2 starts on what is left
        {"b2": 2},
    ]


def test_set_priority_moves_a_request_and_its_class_test_together() -> None:
    """is_interactive is an attribute (read several times a request a step): it follows
    set_priority (the simulator's fcfs policy puts batch requests in one class)."""
    request = Request("b", [1, 2], SamplingParams(max_tokens=1), arrival_time=0.0, priority=BATCH)
    assert (request.priority, request.is_interactive) == (BATCH, False)
    request.set_priority(INTERACTIVE)
    assert (request.priority, request.is_interactive) == (INTERACTIVE, True)
    request.set_priority(BATCH)
    assert (request.priority, request.is_interactive) == (BATCH, False)


@pytest.mark.fake("runner")
def test_fake_runner_fcfs_within_a_class() -> None:
    run = make_run(num_blocks=32, budget=100, max_num_seqs=1)
    for req_id, priority in [
        ("b1", BATCH),
        ("i1", INTERACTIVE),
        ("b2", BATCH),
        ("i2", INTERACTIVE),
    ]:
        run.add(req_id, [1, 2], priority, max_tokens=1)
    assert [r.req_id for r in run.scheduler.waiting] == ["i1", "i2", "b1", "b2"]
    run.run()
    assert scheduled_counts(run) == [{"i1": 2}, {"i2": 2}, {"b1": 2}, {"b2": 2}]


@pytest.mark.fake("runner")
def test_fake_runner_long_interactive_prompt_leaves_room_for_waiting_ones_then_takes_the_rest() -> (
    None
):
    """Head-of-line blocking: a running 40-token prompt takes at most the threshold (4)
    while interactive requests wait; they get the rest of the 10-token budget, and what
    they leave goes back to the long prompt in the same step. Without waiting ones, or
    with only batch waiting, it takes the whole budget."""
    run = make_run(num_blocks=64, budget=10, long_prefill_threshold=4)
    run.add("long", list(range(40)), INTERACTIVE, max_tokens=2)
    run.step()
    run.add("s1", [1, 2, 3], INTERACTIVE, max_tokens=2)
    run.add("s2", [4, 5], INTERACTIVE, max_tokens=2)
    run.add("b", [6, 7, 8, 9], BATCH, max_tokens=1)
    run.run()
    assert scheduled_counts(run)[:6] == [
        {"long": 10},
        {"long": 5, "s1": 3, "s2": 2},  # 4 first, then the 1 that s1 and s2 left
        {"long": 10},  # only batch waits: no cut (running order: the prompt first)
        {"long": 10},
        {"long": 5, "s1": 1, "s2": 1, "b": 3},
        {"long": 1, "b": 1},  # s1 and s2 had their 2 tokens
    ]
    assert run.tokens["long"] == reference_generate(list(range(40)), 2)
    assert run.tokens["s1"] == reference_generate([1, 2, 3], 2)


@pytest.mark.fake("runner")
def test_fake_runner_long_prefill_threshold_zero_is_off_and_negative_is_refused() -> None:
    run = make_run(num_blocks=64, budget=10, long_prefill_threshold=0)
    run.add("long", list(range(40)), INTERACTIVE, max_tokens=1)
    run.step()
    run.add("s", [1, 2, 3], INTERACTIVE, max_tokens=1)
    run.step()
    assert scheduled_counts(run) == [{"long": 10}, {"long": 10}]
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be at least 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    # Plain fcfs (the comparison policy, vLLM's default) runs without the cut.
    config = SchedulerConfig(long_prefill_token_threshold=64)
    assert config.under("priority") is config
    assert config.under("fcfs").long_prefill_token_threshold == 0


# -- the harvest budget ----------------------------------------------------------------


@pytest.mark.fake("runner")
def test_fake_runner_batch_token_budget_caps_batch_and_never_interactive() -> None:
    run = make_run(num_blocks=32, budget=100)
    run.add("i", [1, 2, 3, 4, 5, 6], INTERACTIVE, max_tokens=4)
    run.add("b1", list(range(10, 20)), BATCH, max_tokens=2)
    run.add("b2", [7, 8, 9], BATCH, max_tokens=2)
    budgets = [4, 4, 4, 0, 1, None]
    for batch_token_budget in budgets:
        run.step(batch_token_budget)
    assert scheduled_counts(run) == [
        {"i": 6, "b1": 4},  # i is not held to the 4; b2 gets nothing
        {"i": 1, "b1": 4},
        {"i": 1, "b1": 2, "b2": 2},  # b1's prompt is done, b2 gets the 2 left
        {"i": 1},  # no batch tokens at all; i finishes
        {"b1": 1},  # b1 finishes; b2's last prompt token waits for budget
        {"b2": 1},
    ]
    run.run()
    assert run.tokens == {
        "i": reference_generate([1, 2, 3, 4, 5, 6], 4),
        "b1": reference_generate(list(range(10, 20)), 2),
        "b2": reference_generate([7, 8, 9], 2),
    }


def test_batch_token_budget_must_not_be_negative() -> None:
    run = make_run(num_blocks=4)
    with pytest.raises(ValueError, match="batch_token_budget must be at least 0, got -1"):
        run.scheduler.schedule(0.0, batch_token_budget=-1)


# -- preemption ----------------------------------------------------------------------


@pytest.mark.fake("runner")
def test_fake_runner_waiting_interactive_preempts_newest_batch_when_blocks_run_out() -> None:
    run = make_run(num_blocks=6)
    run.add("b1", [1, 2, 3, 4], BATCH, max_tokens=3)
    b2 = run.add("b2", [5, 6, 7, 8], BATCH, max_tokens=3)
    run.step()
    assert (run.blocks("b1"), run.blocks("b2"), run.kv.num_free_blocks) == ([0, 1], [2, 3], 2)
    run.add("i", [9, 10, 11, 12, 13, 14], INTERACTIVE, max_tokens=2)
    out = run.step()
    # i needs 3 blocks, 2 are free: b2 (the newest batch request) goes, not b1.
    assert out.preempted_req_ids == ("b2",)
    assert plain(out, run.runner) == [
        sr("i", [9, 10, 11, 12, 13, 14], 0, [4, 5, 3], True),
        sr("b1", [run.tokens["b1"][0]], 4, [0, 1, 2], True),
    ]
    assert (b2.status, b2.num_preemptions) == (RequestStatus.PREEMPTED, 1)
    assert [r.req_id for r in run.scheduler.waiting] == ["b2"]
    assert run.scheduler.num_preemptions_by_priority == {INTERACTIVE: 0, BATCH: 1}
    # i's first decode needs a fourth block: b1, the only batch request left, goes too.
    out = run.step()
    assert out.preempted_req_ids == ("b1",)
    assert out.num_scheduled_tokens == {"i": 1}
    assert [r.req_id for r in run.scheduler.waiting] == ["b1", "b2"]
    run.run()
    assert scheduled_counts(run)[3:] == [{"b1": 2, "b2": 5}, {"b2": 1}]
    assert run.tokens == {
        "b1": reference_generate([1, 2, 3, 4], 3),
        "b2": reference_generate([5, 6, 7, 8], 3),
        "i": reference_generate([9, 10, 11, 12, 13, 14], 2),
    }
    assert run.scheduler.num_preemptions_by_priority == {INTERACTIVE: 0, BATCH: 2}


@pytest.mark.fake("runner")
def test_fake_runner_waiting_interactive_preempts_newest_batch_for_a_sequence_slot() -> None:
    run = make_run(num_blocks=32, max_num_seqs=2)
    run.add("b1", [1, 2], BATCH, max_tokens=4)
    run.add("b2", [3, 4], BATCH, max_tokens=4)
    run.add("b3", [5, 6], BATCH, max_tokens=4)
    run.step()
    assert [r.req_id for r in run.scheduler.running] == ["b1", "b2"]
    run.add("i", [7, 8], INTERACTIVE, max_tokens=2)
    out = run.step()
    assert out.preempted_req_ids == ("b2",)
    assert out.num_scheduled_tokens == {"i": 2, "b1": 1}
    # b2 is back at the front of the batch queue, ahead of b3 which arrived after it.
    assert [r.req_id for r in run.scheduler.waiting] == ["b2", "b3"]
    run.run()
    assert run.scheduler.num_preemptions_by_priority == {INTERACTIVE: 0, BATCH: 1}
    assert run.tokens["b2"] == reference_generate([3, 4], 4)


@pytest.mark.fake("runner")
def test_fake_runner_batch_never_preempts_interactive() -> None:
    run = make_run(num_blocks=4, budget=100)
    run.add("b", [1, 2], BATCH, max_tokens=5)
    run.step()
    i = run.add("i", [3, 4, 5, 6], INTERACTIVE, max_tokens=3)  # newer than b, blocks for both
    run.step()
    assert run.scheduler.num_preemptions == 0
    assert (run.blocks("i"), run.blocks("b"), run.kv.num_free_blocks) == ([1, 2], [0, 3], 0)
    # Both need a fourth block now. i is served first and b, short of one, preempts
    # itself (the only batch request) rather than the newer interactive one.
    out = run.step()
    assert out.preempted_req_ids == ("b",)
    assert out.num_scheduled_tokens == {"i": 1}
    run.run()
    assert i.num_preemptions == 0
    assert run.scheduler.num_preemptions_by_priority == {INTERACTIVE: 0, BATCH: 1}
    assert run.tokens == {
        "b": reference_generate([1, 2], 5),
        "i": reference_generate([3, 4, 5, 6], 3),
    }


@pytest.mark.fake("runner")
def test_fake_runner_running_interactive_preempts_batch_first_then_newest_interactive() -> None:
    run = make_run(num_blocks=5)
    run.add("i1", [1, 2], INTERACTIVE, max_tokens=6)
    run.add("b", [3, 4], BATCH, max_tokens=6)
    run.add("i2", [5, 6], INTERACTIVE, max_tokens=6)
    run.add("i3", [7, 8], INTERACTIVE, max_tokens=6)
    run.step()
    assert [r.req_id for r in run.scheduler.running] == ["i1", "i2", "i3", "b"]
    assert run.kv.num_free_blocks == 1
    # Every request needs a second block: i1 takes the free one; i2 preempts b (batch,
    # though older than i3), and i3 preempts itself (the newest interactive).
    out = run.step()
    assert out.preempted_req_ids == ("b", "i3")
    assert out.num_scheduled_tokens == {"i1": 1, "i2": 1}
    assert [r.req_id for r in run.scheduler.waiting] == ["i3", "b"]
    run.run()
    # Later, within interactive, the newest goes as before (i2 preempts itself, i3 is
    # preempted by i2), and b only runs once no interactive request waits.
    assert [out.preempted_req_ids for out in run.runner.scheduler_outputs] == [
        (),
        ("b", "i3"),
        (),
        ("i2",),
        (),
        (),
        (),
        (),
        ("i3",),
        (),
        (),
        ("b",),
        (),
        (),
        (),
    ]
    assert run.scheduler.num_preemptions_by_priority == {INTERACTIVE: 3, BATCH: 2}
    assert run.tokens == {
        "i1": reference_generate([1, 2], 6),
        "b": reference_generate([3, 4], 6),
        "i2": reference_generate([5, 6], 6),
        "i3": reference_generate([7, 8], 6),
    }


@pytest.mark.parametrize(
    ("caching", "num_recomputed", "block_ids"),
    [(True, 2, [0, 1, 2, 6]), (False, 8, [6, 7, 3, 2])],
)
@pytest.mark.fake("runner")
def test_fake_runner_preempted_batch_resumes_ahead_of_later_batch_and_recomputes_its_uncached_tail(
    caching: bool, num_recomputed: int, block_ids: list[int]
) -> None:
    run = make_run(num_blocks=8, max_num_seqs=1, caching=caching)
    b1 = run.add("b1", [1, 2, 3, 4, 5, 6], BATCH, max_tokens=4)
    run.add("b2", [7, 8], BATCH, max_tokens=1)
    run.step()
    run.step()
    assert (b1.num_computed_tokens, run.blocks("b1")) == (7, [0, 1, 2, 3])
    run.add("i", [20, 21, 22], INTERACTIVE, max_tokens=2)
    out = run.step()
    assert out.preempted_req_ids == ("b1",)
    assert plain(out, run.runner) == [sr("i", [20, 21, 22], 0, [4, 5], True)]
    assert [r.req_id for r in run.scheduler.waiting] == ["b1", "b2"]
    run.step()  # i finishes
    # b1 comes back before b2: with the prefix cache its three full prompt blocks hit,
    # and only the two tokens it had sampled ([t1, t2], the last block) are recomputed.
    out = run.step()
    t1, t2 = run.tokens["b1"][:2]
    start = 8 - num_recomputed
    assert plain(out, run.runner) == [
        sr("b1", [1, 2, 3, 4, 5, 6, t1, t2][start:], start, block_ids, True)
    ]
    run.run()
    assert scheduled_counts(run)[4:] == [{"b1": num_recomputed}, {"b1": 1}, {"b2": 2}]
    assert run.tokens == {
        "b1": reference_generate([1, 2, 3, 4, 5, 6], 4),
        "b2": reference_generate([7, 8], 1),
        "i": reference_generate([20, 21, 22], 2),
    }


@pytest.mark.parametrize(
    ("reserve_max_fraction", "preemptions"),
    [(0.0, {"b0": 1, "b1": 4, "b2": 2}), (0.5, {"b1": 1, "b2": 3})],
)
@pytest.mark.fake("runner")
def test_fake_runner_mixed_load_preempts_only_batch_and_the_reserve_cuts_the_churn(
    reserve_max_fraction: float, preemptions: dict[str, int]
) -> None:
    run = make_run(
        num_blocks=12,
        budget=8,
        max_num_seqs=4,
        reserve_max_fraction=reserve_max_fraction,
        reserve_window_s=5.0,
    )
    batch = {f"b{k}": [k, k + 1, k + 2, k + 3] for k in range(3)}
    for req_id, prompt in batch.items():
        run.add(req_id, prompt, BATCH, max_tokens=10)
    interactive = {f"i{k}": [50 + k, 51, 52, 53, 54] for k in range(4)}
    arrivals = dict(zip((0, 3, 6, 9), interactive, strict=True))
    for step in range(100):
        if step in arrivals:
            run.add(arrivals[step], interactive[arrivals[step]], INTERACTIVE, max_tokens=4)
        if step > 9 and not run.scheduler.has_unfinished_requests():
            break
        run.step()
        run.now += 1.0
    # Every interactive request is admitted on arrival and decodes every step after: the
    # batch requests yield to it, never the other way round.
    for k, arrival in enumerate(arrivals):
        steps = [n for n, counts in enumerate(scheduled_counts(run)) if f"i{k}" in counts]
        assert steps == [arrival, arrival + 1, arrival + 2, arrival + 3]
    assert _preemptions(run) == preemptions
    assert run.scheduler.num_preemptions_by_priority == {
        INTERACTIVE: 0,
        BATCH: sum(preemptions.values()),
    }
    assert run.tokens == {
        **{r: reference_generate(p, 10) for r, p in batch.items()},
        **{r: reference_generate(p, 4) for r, p in interactive.items()},
    }


def _preemptions(run: Run) -> dict[str, int]:
    counts: dict[str, int] = {}
    for out in run.runner.scheduler_outputs:
        for req_id in out.preempted_req_ids:
            counts[req_id] = counts.get(req_id, 0) + 1
    return counts


# -- the interactive reserve -----------------------------------------------------------


@pytest.mark.fake("runner")
def test_fake_runner_batch_cannot_take_the_reserved_blocks_but_interactive_can() -> None:
    run = make_run(num_blocks=10, budget=4, reserve_min_blocks=3, reserve_max_fraction=0.5)
    i0 = run.add("i0", [1, 2], INTERACTIVE, max_tokens=12)
    b = run.add("b", list(range(10, 26)), BATCH, max_tokens=1)
    for _ in range(3):
        run.step()
    assert scheduled_counts(run) == [{"i0": 2, "b": 2}, {"i0": 1, "b": 3}, {"i0": 1, "b": 3}]
    assert (len(run.blocks("i0")), len(run.blocks("b")), run.kv.num_free_blocks) == (2, 4, 4)
    # b's next chunk wants 2 more blocks and would leave 1 free, under the reserve of 3:
    # it waits, keeping its blocks, while i0 grows into the reserve.
    for _ in range(3):
        assert run.step().num_scheduled_tokens == {"i0": 1}
        assert run.scheduler.reserve_blocks == 3
    assert (b.num_computed_tokens, len(run.blocks("b")), run.kv.num_free_blocks) == (8, 4, 2)
    # An interactive arrival takes reserved blocks at once, with no preemption.
    run.add("i1", [3, 4], INTERACTIVE, max_tokens=2)
    out = run.step()
    assert out.num_scheduled_tokens == {"i0": 1, "i1": 2}
    assert out.preempted_req_ids == ()
    assert run.kv.num_free_blocks == 1
    # i1's first decode needs a block and none is free: b, batch, is preempted for it.
    out = run.step()
    assert (out.num_scheduled_tokens, out.preempted_req_ids) == ({"i0": 1, "i1": 1}, ("b",))
    # The reserve has risen to its cap (5 of 10 blocks) with the interactive peak, so b
    # gets back in only once it is alone in the cache, waived of the reserve then.
    assert run.scheduler.reserve_blocks == 5
    run.run()
    assert scheduled_counts(run)[8:] == [{"i0": 1}] * 4 + [{"b": 4}] * 3 + [{"b": 2}]
    assert run.scheduler.num_preemptions_by_priority == {INTERACTIVE: 0, BATCH: 1}
    assert i0.num_preemptions == 0
    assert run.tokens == {
        "i0": reference_generate([1, 2], 12),
        "b": reference_generate(list(range(10, 26)), 1),
        "i1": reference_generate([3, 4], 2),
    }


@pytest.mark.fake("runner")
def test_fake_runner_reserve_follows_interactive_demand_and_decays_after_the_window() -> None:
    run = make_run(num_blocks=10, block_size=8, reserve_max_fraction=0.5, reserve_window_s=10.0)
    run.add("b0", [1], BATCH, max_tokens=30)
    run.add("i", list(range(100, 132)), INTERACTIVE, max_tokens=1)  # 4 blocks, for one step
    out = run.step()  # at t=2
    assert out.num_scheduled_tokens == {"i": 32, "b0": 1}
    assert run.scheduler.reserve_blocks == 0  # nothing seen yet
    run.add("b1", list(range(200, 248)), BATCH, max_tokens=1)  # 6 blocks
    reserves, counts = [], []
    for t in range(3, 14):
        run.now = float(t)
        counts.append(run.step().num_scheduled_tokens)
        reserves.append(run.scheduler.reserve_blocks)
    # i held 4 blocks at t=2: for the next 10 s batch leaves 4 free, so b1 (6 of the 9
    # free blocks) waits; at t=12 that peak leaves the window and b1 gets in.
    assert reserves == [4] * 9 + [0, 0]
    assert counts == [{"b0": 1}] * 9 + [{"b0": 1, "b1": 48}, {"b0": 1}]
    run.run()
    assert run.tokens["b1"] == reference_generate(list(range(200, 248)), 1)


# -- InteractiveReserve ----------------------------------------------------------------


def test_interactive_reserve_is_the_window_peak_times_margin_clamped() -> None:
    reserve = InteractiveReserve(100, window_s=10.0, margin=1.2, min_blocks=2, max_fraction=0.25)
    assert reserve.blocks(0.0) == 2  # nothing seen: the floor
    reserve.observe(0.0, 10)
    reserve.observe(1.0, 4)
    reserve.observe(2.0, 7)
    assert (reserve.peak(2.0), reserve.blocks(2.0)) == (10, 12)  # 10 * 1.2, not 13
    assert reserve.blocks(9.99) == 12
    assert (reserve.peak(10.0), reserve.blocks(10.0)) == (7, 9)  # t=0 left; 7 * 1.2 = 8.4
    assert (reserve.peak(11.5), reserve.blocks(11.5)) == (7, 9)  # t=1's 4 is below 7
    assert (reserve.peak(12.0), reserve.blocks(12.0)) == (0, 2)  # all gone: the floor
    reserve.observe(13.0, 30)
    assert reserve.blocks(13.0) == 25  # 36 capped at a quarter of 100 blocks
    reserve.observe(14.0, 1)
    assert reserve.blocks(22.9) == 25
    assert reserve.blocks(23.0) == 2  # only t=14's 1 block: 1.2 -> 2, and the floor is 2


def test_interactive_reserve_cap_wins_over_the_floor() -> None:
    reserve = InteractiveReserve(10, window_s=1.0, margin=2.0, min_blocks=4, max_fraction=0.0)
    reserve.observe(0.0, 5)
    assert reserve.blocks(0.0) == 0


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("window_s", 0.0, "window_s must be positive, got 0.0"),
        ("margin", -0.5, "margin must be at least 0, got -0.5"),
        ("min_blocks", -1, "min_blocks must be at least 0, got -1"),
        ("max_fraction", 1.0, r"max_fraction must be in \[0, 1\), got 1.0"),
        ("max_fraction", -0.1, r"max_fraction must be in \[0, 1\), got -0.1"),
    ],
)
def test_reserve_settings_are_checked(setting: str, value: float, message: str) -> None:
    settings_ = {"window_s": 1.0, "margin": 1.0, "min_blocks": 0, "max_fraction": 0.1}
    with pytest.raises(ValueError, match=f"^{message}$"):
        InteractiveReserve(10, **{**settings_, setting: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"^interactive_reserve_{message}$"):
        SchedulerConfig(**{f"interactive_reserve_{setting}": value})  # type: ignore[arg-type]


def test_scheduler_config_reserve_defaults() -> None:
    config = SchedulerConfig()
    assert (
        config.interactive_reserve_window_s,
        config.interactive_reserve_margin,
        config.interactive_reserve_min_blocks,
        config.interactive_reserve_max_fraction,
    ) == (30.0, 1.2, 0, 0.2)


# -- PriorityRequestQueue --------------------------------------------------------------


def test_priority_queue_pops_most_urgent_class_first_fcfs_within() -> None:
    def req(req_id: str, priority: int) -> Request:
        return Request(req_id, [1], SamplingParams(), arrival_time=0.0, priority=priority)

    queue = PriorityRequestQueue()
    b1, i1, b2, i2, x = (
        req("b1", BATCH),
        req("i1", INTERACTIVE),
        req("b2", BATCH),
        req("i2", INTERACTIVE),
        req("x", 5),
    )
    for request in (x, b1, i1, b2, i2):
        queue.add(request)
    assert [r.req_id for r in queue] == ["i1", "i2", "b1", "b2", "x"]
    assert (len(queue), queue.priorities, queue.num_waiting(BATCH)) == (
        5,
        [INTERACTIVE, BATCH, 5],
        2,
    )
    b3 = req("b3", BATCH)
    queue.prepend(b3)  # front of its own class only
    assert [r.req_id for r in queue] == ["i1", "i2", "b3", "b1", "b2", "x"]
    queue.remove(i2)
    assert [queue.pop().req_id for _ in range(2)] == ["i1", "b3"]
    assert queue.priorities == [BATCH, 5]
    queue.remove(x)
    assert (queue.peek().req_id, queue.priorities) == ("b1", [BATCH])
    assert [queue.pop().req_id for _ in range(2)] == ["b1", "b2"]
    assert not queue and len(queue) == 0 and queue.priorities == []
    with pytest.raises(IndexError):
        queue.peek()


# -- any mix of classes: same text, same limits ---------------------------------------


@dataclass
class Workload:
    settings: dict[str, Any]  # make_run's keywords
    # (prompt, max_tokens, arrival step, priority) per request
    requests: list[tuple[list[int], int, int, int]]
    batch_budgets: list[int | None]  # used in turn, one a step


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        # prompts from a 2-token alphabet with shared prefixes, so prefix hits happen
        prefix = draw(st.sampled_from([[], [0, 1, 0, 1], [0, 1, 0, 1, 1, 1, 0, 0]]))
        prompt = (prefix + draw(st.lists(st.integers(0, 1), max_size=14))) or [0]
        arrival = draw(st.integers(0, 6))
        requests.append(
            (prompt, draw(st.integers(1, 6)), arrival, draw(st.sampled_from([INTERACTIVE, BATCH])))
        )
    block_size = draw(st.sampled_from([1, 2, 4]))
    # Every request fits the cache on its own (as EngineCore guarantees via max_model_len).
    longest = max(len(prompt) + max_tokens for prompt, max_tokens, _, _ in requests)
    settings = {
        "num_blocks": cdiv(longest, block_size) + draw(st.integers(0, 4)),
        "block_size": block_size,
        "budget": draw(st.integers(1, 24)),
        "max_num_seqs": draw(st.integers(1, 4)),
        "caching": draw(st.booleans()),
        "reserve_max_fraction": draw(st.sampled_from([0.0, 0.25, 0.5, 0.9])),
        "reserve_min_blocks": draw(st.integers(0, 3)),
        "reserve_margin": draw(st.sampled_from([0.5, 1.0, 2.0])),
        "reserve_window_s": 3.0,
        "long_prefill_threshold": draw(st.sampled_from([0, 1, 3])),
    }
    budgets = st.lists(st.one_of(st.none(), st.integers(1, 8)), min_size=1, max_size=8)
    return Workload(settings, requests, draw(budgets))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
@pytest.mark.fake("runner")
def test_fake_runner_random_mixed_classes_respect_the_rules_and_match_reference(
    workload: Workload,
) -> None:
    run = make_run(**workload.settings)
    requests = workload.requests
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    expected = {}
    step = 0
    while pending or run.scheduler.has_unfinished_requests():
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            prompt, max_tokens, _, priority = requests[i]
            run.add(f"r{i}", prompt, priority, max_tokens)
            expected[f"r{i}"] = reference_generate(prompt, max_tokens)
        run.step(workload.batch_budgets[step % len(workload.batch_budgets)])
        run.now += 0.5
        step += 1
        assert step < 1000, "livelock"
    assert run.tokens == expected
    assert run.finish_reasons == dict.fromkeys(expected, "length")
    kv = run.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and kv.req_to_blocks == {}
    by_priority = run.scheduler.num_preemptions_by_priority
    assert sum(by_priority.values()) == run.scheduler.num_preemptions
    event(f"batch preemptions: {min(by_priority[BATCH], 3)}")
    event(f"interactive preemptions: {min(by_priority[INTERACTIVE], 3)}")
