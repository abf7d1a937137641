"""One simulated replica: the engine's own Scheduler and KVCacheManager, timed by a cost
model in place of the model runner.

A step is what EngineCore.step does, on the virtual clock: schedule(now) with the harvest
budget (priority policy) or none (fcfs), price the SchedulerOutput with the cost model,
and at the step's end update() with one sampled token per sampling request.

Leaps. Most steps of a loaded replica are the same decode-only step over and over. When a
step schedules every running request for one decode token, nothing waits that could get
in, and the next steps would do the same, the replica plans k of them at once:

    step 1 (scheduled by the real scheduler) | step 2 | ... | step k | next real step
    ^ now                                    ^ ends[0]              ^ ends[k-1]

k stops before the first request finishes, before the blocks run short (the reserve's
cap left free), and before the harvest budget would drop a batch decode. At its end (or
when an arrival cuts it at time t) the steps done by then are applied in bulk to the real
KVCacheManager and Requests (allocate_slots for j tokens, j tokens appended), and the
step in flight at t is scheduled by the real scheduler, as step-by-step would have.
Equal to step-by-step in every request's timing and in the blocks held (a test runs
both); only which block ids a request holds differ, and the prefix-query counters of a
waiting head that could not get in.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from tokenfleet.config import SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreOutput
from tokenfleet.core.kv_cache import KVCacheManager
from tokenfleet.core.request import PRIORITY_INTERACTIVE, Request
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.policy.harvest import PriorityBudgets, StepCost, batch_chunks
from tokenfleet.policy.step_model import StepFeatures, step_features
from tokenfleet.sim.budget import batch_decodes_fit

# Every sampled token: prompts never contain it, and no request stops on it.
OUTPUT_TOKEN = 1
POLICIES = ("priority", "fcfs")


@dataclass(frozen=True)
class ReplicaConfig:
    num_kv_blocks: int
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    block_size: int = 16
    enable_prefix_caching: bool = True
    policy: str = "priority"
    tpot_target_s: float = 0.06
    harvest_margin: float = 0.1
    min_prefill_chunk: int = 16
    batch_step_limit_s: float | None = None
    leap: bool = True
    max_leap_steps: int = 4096

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.num_kv_blocks < 1 or self.max_leap_steps < 1:
            raise ValueError("num_kv_blocks and max_leap_steps must be at least 1")


# (time, what the step that ended then gave each request)
StepOutputs = tuple[float, list[EngineCoreOutput]]


@dataclass
class _Leap:
    """Steps 2..k planned after the real step 1; ends[i] is step i+1's end."""

    first: SchedulerOutput
    ends: list[float]
    computed: np.ndarray  # each running request's num_computed_tokens after step 1
    held: np.ndarray  # and its blocks


class SimReplica:
    def __init__(
        self, replica_id: int, config: ReplicaConfig, cost: StepCost, step_model: StepCost
    ) -> None:
        self.replica_id = replica_id
        self.config = config
        self.cost = cost  # what a step takes
        self.step_model = step_model  # what the scheduler's harvest budget believes
        self.kv = KVCacheManager(
            config.num_kv_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler.under(config.policy), self.kv)
        self.busy_until: float | None = None  # end of the step or leap in flight
        self._step: SchedulerOutput | None = None
        self._leap: _Leap | None = None
        self.num_leaps = 0
        self.num_leap_steps = 0  # steps applied in bulk
        self.num_cuts = 0

    # -- requests ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if self.config.policy == "fcfs":  # one class: arrival order alone decides
            request.set_priority(PRIORITY_INTERACTIVE)
        self.scheduler.add_request(request)

    @property
    def idle(self) -> bool:
        return self.busy_until is None

    # -- steps ---------------------------------------------------------------------

    def start_step(self, now: float, *, may_leap: bool = True) -> float | None:
        """Schedule the next step at `now`; its end (or the leap's), None when idle."""
        output = self._schedule(now)
        if output.is_empty:
            self.busy_until = self._step = None
            return None
        self._step = output
        end = now + self.cost.predict(step_features(output))
        leap = self._plan_leap(output, end) if may_leap and self.config.leap else None
        self._leap = leap
        self.busy_until = leap.ends[-1] if leap else end
        return self.busy_until

    def end_step(self) -> list[StepOutputs]:
        """Apply the step (or the whole leap) in flight, which ends at busy_until."""
        assert self._step is not None and self.busy_until is not None
        if self._leap is not None:
            outputs = self._apply_leap(self._leap, len(self._leap.ends))
        else:
            outputs = [(self.busy_until, self._update(self._step))]
        self._step = self._leap = None
        self.busy_until = None
        return outputs

    def cut(self, now: float) -> list[StepOutputs]:
        """Stop a leap at `now` so that the replica can take a request: the steps done by
        then are applied, the one in flight becomes a plain step (busy_until its end)."""
        leap = self._leap
        if leap is None:
            return []
        self._leap = None
        self.num_cuts += 1
        num_done = bisect.bisect_right(leap.ends, now)
        assert num_done < len(leap.ends), "a leap ending before now was not ended"
        if num_done == 0:
            self.busy_until = leap.ends[0]
            return []
        outputs = self._apply_leap(leap, num_done)
        start = leap.ends[num_done - 1]
        step = self._schedule(start)
        assert len(step.scheduled) == len(leap.first.scheduled), "a leap step changed"
        self._step = step
        self.busy_until = start + self.cost.predict(step_features(step))
        return outputs

    def blocks_used(self, now: float) -> int:
        """KV blocks in use at `now`, counting the leap steps begun by then."""
        used = self.kv.pool.num_used_blocks
        leap = self._leap
        if leap is None:
            return used
        num_begun = min(bisect.bisect_right(leap.ends, now) + 1, len(leap.ends))
        return used + self._leap_blocks(leap, num_begun)

    # -- the real scheduler --------------------------------------------------------

    def _schedule(self, now: float) -> SchedulerOutput:
        if self.config.policy == "fcfs":
            return self.scheduler.schedule(now)
        budgets = PriorityBudgets.from_config(self.scheduler, self.step_model, self.config)
        return budgets.schedule(now)

    def _update(self, output: SchedulerOutput) -> list[EngineCoreOutput]:
        sampled = {s.req_id: OUTPUT_TOKEN for s in output.scheduled if s.sample}
        return self.scheduler.update(output, ModelRunnerOutput(sampled_token_ids=sampled))

    # -- leaps ---------------------------------------------------------------------

    def _plan_leap(self, first: SchedulerOutput, first_end: float) -> _Leap | None:
        running = self.scheduler.running
        if not self._repeats(first):
            return None
        max_len = self.scheduler.config.max_model_len
        # Request r samples its last token in step min(max_tokens - out, max_len - tokens).
        num_steps = min(
            min(r.sampling_params.max_tokens - r.num_output_tokens, max_len - r.num_tokens)
            for r in running
        )
        num_steps = min(num_steps - 1, self.config.max_leap_steps)
        if num_steps < 2:
            return None
        leap = _Leap(
            first,
            [first_end],
            np.array([r.num_computed_tokens for r in running], dtype=np.int64),
            np.array([len(self.kv.req_to_blocks[r.req_id]) for r in running], dtype=np.int64),
        )
        free = self.kv.num_free_blocks - self.scheduler.reserve.max_blocks
        num_steps = _largest(num_steps, lambda k: self._leap_blocks(leap, k) <= free)
        num_steps = _largest(num_steps, self._keeps_batch)
        if num_steps < 2:
            return None
        kv_read = step_features(first).kv_tokens_read
        for i in range(1, num_steps):
            features = StepFeatures(
                decode_seqs=len(running), kv_tokens_read=kv_read + i * len(running)
            )
            leap.ends.append(leap.ends[-1] + self.cost.predict(features))
        self.num_leaps += 1
        return leap

    def _repeats(self, first: SchedulerOutput) -> bool:
        """Whether the next steps would be `first` again, one token further: every running
        request decodes in it, and no waiting one can get in (none, or the sequence slots
        are full and none waiting may preempt a running one)."""
        sched = self.scheduler
        if first.preempted_req_ids or len(first.scheduled) != len(sched.running):
            return False
        if any(s.num_tokens != 1 or not s.sample for s in first.scheduled):
            return False
        if not sched.waiting:
            return True
        if len(sched.running) < sched.config.max_num_seqs:
            return False
        return min(sched.waiting.priorities) >= max(r.priority for r in sched.running)

    def _leap_blocks(self, leap: _Leap, num_steps: int) -> int:
        """New blocks that steps 2..num_steps take (step 1's are held already)."""
        size = self.kv.block_size
        needed = (leap.computed + num_steps - 1 + size - 1) // size - leap.held
        return int(np.maximum(needed, 0).sum())

    def _keeps_batch(self, num_steps: int) -> bool:
        """Whether step `num_steps`'s harvest budget still takes every batch decode (the
        budget only shrinks as contexts grow, so then every earlier step's does too)."""
        sched = self.scheduler
        if self.config.policy != "priority":
            return True
        shift = num_steps - 1  # tokens every request is further on than in step 1
        interactive = [r.num_computed_tokens - 1 + shift for r in sched.running if r.is_interactive]
        batch = [r.num_computed_tokens - 1 + shift for r in sched.running if not r.is_interactive]
        limit = self.config.batch_step_limit_s
        if not batch or (not interactive and limit is None):
            return True
        waiting = batch_chunks((), sched.waiting, sched.config.max_num_seqs, self.kv.block_size)
        return batch_decodes_fit(
            self.step_model,
            interactive,
            batch,
            waiting,
            tpot_target_s=self.config.tpot_target_s,
            margin=self.config.harvest_margin,
            max_num_batched_tokens=sched.config.max_num_batched_tokens,
            batch_step_limit_s=limit,
        )

    def _apply_leap(self, leap: _Leap, num_done: int) -> list[StepOutputs]:
        """Apply the leap's first `num_done` steps: step 1 through the scheduler's update,
        steps 2..num_done in bulk."""
        outputs = [(leap.ends[0], self._update(leap.first))]
        if num_done > 1:
            self._advance(num_done - 1, leap.ends[num_done - 2])
        return outputs

    def _advance(self, num_steps: int, last_start: float) -> None:
        """Every running request decodes `num_steps` tokens, as that many steps would have
        done: the blocks for them, the tokens, the steps counted, and the reserve told what
        interactive requests hold at the last one's start (their blocks only grew, so the
        earlier reports would have been dropped for this one)."""
        sched = self.scheduler
        for request in sched.running:
            blocks = self.kv.allocate_slots(request, num_steps)
            assert blocks is not None, "a leap ran out of blocks"
            request.all_token_ids.extend(repeat(OUTPUT_TOKEN, num_steps))
            request.num_computed_tokens += num_steps
        sched.num_steps += num_steps
        self.num_leap_steps += num_steps
        sched.reserve.observe(last_start, sched._num_interactive_blocks())


def _largest(most: int, ok: Callable[[int], bool]) -> int:
    """The largest k in [1, most] with ok(k), ok being true up to some k and false after
    (1 when ok(1) is false too)."""
    low, high = 1, most
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low
