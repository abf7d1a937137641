"""Admission's replay (policy/admission.py's Replay) held against the real Scheduler on the
same queue: without KV pressure (blocks to spare, no interactive reserve) or prefix hits
(prefix caching off), the token split it predicts equals the scheduler's, step by step,
under fcfs (one class), priority classes without budgets, and the priority policy with
harvest's budgets (PriorityBudgets, as the engine plans); the steps are driven by the
FakeModelRunner. bench/admission_error.py measures the error on queues with KV pressure
or prefix hits. The folded replay (Replay's `fold`: the interactive class's head decodes
as counts, predict_ttft's default) is held to the same steps (its requests' split and
each step's features) and its predictions to the plain replay's, exactly."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fake_runner import FakeModelRunner

from tokenfleet.config import SchedulerConfig
from tokenfleet.core.kv_cache import KVCacheManager
from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE, Request
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.policy.admission import Decodes, Replay, StepLimit, predict_ttft
from tokenfleet.policy.harvest import PriorityBudgets, step_time_limit
from tokenfleet.policy.step_model import TERMS, LinearStepCost, step_features

BLOCK_SIZE = 16
# Seconds (in ticks) a step costs: its intercept, a prefill token, a decode, a KV token
# read, a query token x context. With a target of a few ticks, prompts beside decodes are
# cut to tens of tokens and batch gets what is left of the limit.
MODEL = LinearStepCost((1.0, 0.05, 0.2, 0.001, 0.0001))
MARGIN = 0.25
# Nothing finishes within the steps compared: no EOS, no length limit reached.
NEVER_ENDS = SamplingParams(max_tokens=10**6, ignore_eos=True)
MODES = ("fcfs", "classes", "priority")


@dataclass(frozen=True)
class Queue:
    """Requests (prompt length, interactive, the step it arrives before), the scheduler's
    settings and how it is driven: fcfs (every request in one class, no budgets), classes
    (interactive and batch, no budgets) or priority (classes, harvest's budgets)."""

    requests: list[tuple[int, bool, int]]
    mode: str
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 8
    long_prefill_cap: int = 0
    tpot_target_s: float = 4.0
    min_prefill_chunk: int = 4
    batch_step_limit_s: float | None = None

    @property
    def limit(self) -> StepLimit | None:
        if self.mode != "priority":
            return None
        seconds = step_time_limit(self.tpot_target_s, MARGIN)
        return StepLimit(seconds, self.min_prefill_chunk, self.tpot_target_s)


class Engine:
    """The real Scheduler over a KV cache with blocks to spare and no prefix caching,
    stepped by the FakeModelRunner as EngineCore.step plans (PriorityBudgets under the
    priority policy)."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        config = SchedulerConfig(
            max_num_batched_tokens=queue.max_num_batched_tokens,
            max_num_seqs=queue.max_num_seqs,
            max_model_len=1 << 20,
            long_prefill_token_threshold=queue.long_prefill_cap,
            interactive_reserve_max_fraction=0.0,
        )
        kv = KVCacheManager(4096, BLOCK_SIZE, enable_caching=False)
        self.scheduler = Scheduler(config, kv)
        self.runner = FakeModelRunner(BLOCK_SIZE)
        self.now = 0.0

    def add(self, req_id: str, num_tokens: int, interactive: bool) -> None:
        self.now += 1.0
        fcfs = self.queue.mode == "fcfs"
        priority = PRIORITY_INTERACTIVE if interactive or fcfs else PRIORITY_BATCH
        request = Request(
            req_id, [7] * num_tokens, NEVER_ENDS, arrival_time=self.now, priority=priority
        )
        self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        self.now += 1.0
        queue = self.queue
        if queue.mode == "priority":
            budgets = PriorityBudgets(
                self.scheduler,
                MODEL,
                block_size=BLOCK_SIZE,
                tpot_target_s=queue.tpot_target_s,
                margin=MARGIN,
                min_prefill_chunk=queue.min_prefill_chunk,
                batch_step_limit_s=queue.batch_step_limit_s,
            )
            out = budgets.schedule(self.now)
        else:
            out = self.scheduler.schedule(self.now)
        self.scheduler.update(out, self.runner.execute(out))
        return out

    def replay(self, *, fold: bool = False) -> Replay:
        """Admission's Replay of the scheduler's queue as it stands: every request's
        lengths, class and place (running, in order; waiting, in pop order)."""
        config = self.scheduler.config
        replay = Replay(
            config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            long_prefill_cap=config.long_prefill_token_threshold,
            limit=self.queue.limit,
            model=MODEL,
            block_size=BLOCK_SIZE,
            batch_step_limit_s=self.queue.batch_step_limit_s,
            fold=fold,
        )
        running = [(r, True) for r in self.scheduler.running]
        for request, is_running in [*running, *((r, False) for r in self.scheduler.waiting)]:
            replay.add(
                request.req_id,
                request.num_tokens,
                running=is_running,
                num_computed_tokens=request.num_computed_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                interactive=request.is_interactive,
                arrival_time=request.arrival_time,
            )
        return replay


def split_of(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.req_id, s.num_tokens, s.start_pos) for s in out.scheduled]


def check_replay_matches(queue: Queue, num_steps: int = 40) -> tuple[int, int]:
    """Run the scheduler up to the last arrival, then compare `num_steps` steps of the
    Replay of its queue with its own: how many of them scheduled anything, and how many
    requests they preempted."""
    engine = Engine(queue)
    last = max((at for _, _, at in queue.requests), default=0)
    for step in range(last + 1):
        for i, (num_tokens, interactive, at) in enumerate(queue.requests):
            if at == step:
                engine.add(f"r{i}", num_tokens, interactive)
        if step < last:
            engine.step()
    replay, folded = engine.replay(), engine.replay(fold=True)
    busy = num_preempted = 0
    for step in range(num_steps):
        predicted = [(c.request.req_id, c.num_tokens, c.start_pos) for c in replay.step()]
        preempted = [r.req_id for r in replay.planner.last_preempted]
        chunks = folded.step()
        out = engine.step()
        assert predicted == split_of(out), f"step {step} after the snapshot"
        assert preempted == list(out.preempted_req_ids), f"step {step} after the snapshot"
        # The folded replay: its requests' split, the folded decodes' count and the step.
        mine = [(c.request.req_id, c.num_tokens, c.start_pos) for c in chunks]
        ids = {m[0] for m in mine}
        assert mine == [s for s in predicted if s[0] in ids], f"step {step} after the snapshot"
        assert len(mine) + folded.num_folded == len(predicted), f"step {step} after the snapshot"
        assert folded.features(chunks) == step_features(out), f"step {step} after the snapshot"
        assert [r.req_id for r in folded.planner.last_preempted] == preempted
        busy += bool(out.scheduled)
        num_preempted += len(preempted)
    return busy, num_preempted


@pytest.mark.fake("runner")
@pytest.mark.parametrize("mode", MODES)
def test_fake_runner_replay_splits_a_mixed_queue_as_the_scheduler(mode: str) -> None:
    """Streams decoding, a long prompt part-way through its prefill, short and long
    prompts of both classes waiting: every step's split (who, how many tokens, from where)
    is the scheduler's, through prompts finishing and joining the decodes, the long
    prefill cap, cut chunks beside streams and batch within the harvest budget."""
    requests = [
        (20, True, 0),  # streams by the snapshot
        (35, True, 0),
        (90, False, 0),  # batch, decoding or prefilling
        (300, True, 1),  # a long prompt, part-way through
        (12, True, 3),  # waiting at the snapshot
        (150, False, 3),
        (40, True, 3),
        (7, False, 3),
    ]
    queue = Queue(requests, mode, max_num_batched_tokens=64, long_prefill_cap=16)
    assert check_replay_matches(queue, num_steps=30) == (30, 0)


@pytest.mark.fake("runner")
def test_fake_runner_replay_preempts_batch_for_a_sequence_slot_as_the_scheduler() -> None:
    """With every sequence slot taken, a waiting interactive prompt preempts the newest
    running batch request (no KV pressure: a slot), in the replay as in the scheduler."""
    requests = [(10, False, 0), (10, False, 0), (10, True, 0), (30, True, 2), (25, True, 2)]
    queue = Queue(requests, "priority", max_num_seqs=3)
    busy, num_preempted = check_replay_matches(queue, num_steps=20)
    assert busy == 20 and num_preempted >= 1


@pytest.mark.fake("runner")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 200), st.booleans(), st.integers(0, 4)), min_size=1, max_size=10
    ),
    mode=st.sampled_from(MODES),
    max_num_batched_tokens=st.integers(8, 96),
    max_num_seqs=st.integers(1, 8),
    long_prefill_cap=st.sampled_from([0, 1, 8, 32]),
    tpot_target_s=st.sampled_from([1.5, 2.5, 4.0, 16.0]),
    min_prefill_chunk=st.sampled_from([1, 4, 16]),
    batch_step_limit_s=st.sampled_from([None, 1.5, 3.0]),
)
def test_fake_runner_replay_splits_random_queues_as_the_scheduler(
    requests: list[tuple[int, bool, int]],
    mode: str,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    long_prefill_cap: int,
    tpot_target_s: float,
    min_prefill_chunk: int,
    batch_step_limit_s: float | None,
) -> None:
    queue = Queue(
        requests,
        mode,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_cap=long_prefill_cap,
        tpot_target_s=tpot_target_s,
        min_prefill_chunk=min_prefill_chunk,
        batch_step_limit_s=batch_step_limit_s,
    )
    check_replay_matches(queue, num_steps=25)


COEFFICIENTS = dict(zip(TERMS, MODEL.coefficients, strict=True))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_num_batched_tokens=st.integers(1, 96),
    num_prompt_tokens=st.integers(1, 300),
    prompts_ahead=st.lists(st.integers(1, 300), max_size=6),
    interactive=st.tuples(st.integers(0, 40), st.integers(0, 8000)),
    batch=st.tuples(st.integers(0, 40), st.integers(0, 8000)),
    policy=st.sampled_from(["fcfs", "priority"]),
    tpot_target_s=st.sampled_from([1.5, 2.5, 4.0, 16.0]),
    min_prefill_chunk=st.sampled_from([1, 4, 16]),
    batch_in_flight=st.sampled_from([None, True, False]),
    profiled=st.booleans(),
    long_prefill_cap=st.sampled_from([0, 1, 8, 32]),
    stop_over=st.sampled_from([math.inf, 3.0, 30.0, 300.0]),
    max_steps=st.sampled_from([2, 8, 64]),
    max_num_seqs=st.one_of(st.none(), st.integers(1, 60)),
)
def test_folded_replay_predicts_the_plain_replays_ttft_exactly(
    max_num_batched_tokens: int,
    num_prompt_tokens: int,
    prompts_ahead: list[int],
    interactive: tuple[int, int],
    batch: tuple[int, int],
    policy: str,
    tpot_target_s: float,
    min_prefill_chunk: int,
    batch_in_flight: bool | None,
    profiled: bool,
    long_prefill_cap: int,
    stop_over: float,
    max_steps: int,
    max_num_seqs: int | None,
) -> None:
    """predict_ttft folded (its default) and plain: the same float, on random queues of
    decodes (more than the step's tokens or slots too) and prompts, under fcfs and the
    priority policy, with step limits, long prefill caps, max_num_seqs, strides and the
    stop over a target."""
    limit = None
    if policy == "priority":
        seconds = step_time_limit(tpot_target_s, MARGIN)
        limit = StepLimit(seconds, min_prefill_chunk, tpot_target_s)
    profile = {**COEFFICIENTS, "intercept": 0.9} if profiled else None
    args = (
        COEFFICIENTS,
        max_num_batched_tokens,
        num_prompt_tokens,
        prompts_ahead,
        Decodes(*interactive),
        Decodes(*batch),
        limit,
        batch_in_flight,
        profile,
        long_prefill_cap,
        stop_over,
        max_steps,
    )
    folded = predict_ttft(*args, max_num_seqs=max_num_seqs, block_size=BLOCK_SIZE)
    plain = predict_ttft(*args, max_num_seqs=max_num_seqs, block_size=BLOCK_SIZE, fold=False)
    assert folded == plain
