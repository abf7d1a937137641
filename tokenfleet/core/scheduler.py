"""The step planner: which requests advance this step, and by how many tokens.

One rule covers prefill, chunked prefill and decode: a request is given tokens until its
num_computed_tokens catches up with num_tokens, within max_num_batched_tokens and
max_num_seqs. Requests come in priority classes (lower `priority` is more urgent:
interactive 0, batch 1) and each step serves them class by class, most urgent first:

    for each class:  its running requests (in order)  ->  its waiting requests (FCFS)

Batch classes also stay within the step's `batch_token_budget` (the harvest budget,
given, or asked for once the interactive classes are planned: harvest.py) and leave the
interactive reserve free (`reserve.py`); a batch request held back by the reserve alone
waits with its blocks. Interactive prompts still being prefilled share the step's
`prefill_token_budget`, when one is given: the engine sets it while interactive streams
decode, so that a long prompt arriving among them is cut into chunks that keep their
steps within the TPOT target (harvest.prefill_budget). While interactive requests wait,
a running interactive prompt takes at most `long_prefill_token_threshold` tokens until
they are served, then what they left: a long prompt does not hold short ones back.

When blocks or sequence slots run out, the victim is the least urgent class first, the
newest within it, and never more urgent than the request that needs the room: a waiting
interactive request preempts running batch ones, a running request the not-yet-served
ones of its class (itself included) and less urgent ones, and a batch request never
preempts an interactive one, so the classes cannot ping-pong. A preempted request goes
to the front of its class's queue and is later recomputed, mostly from its still-cached
prefix. Time is passed in.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenfleet.config import SchedulerConfig
from tokenfleet.core.block_pool import KVCacheBlock
from tokenfleet.core.engine_api import EngineCoreOutput
from tokenfleet.core.kv_cache import KVCacheManager
from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE, Request, RequestStatus
from tokenfleet.core.request_queue import PriorityRequestQueue
from tokenfleet.core.reserve import InteractiveReserve
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

# Asked once per step, after the interactive classes are planned, with their chunks as
# (num_tokens, start_pos): the step's batch token budget.
BatchTokenBudget = Callable[[list[tuple[int, int]]], int]


@dataclass
class _StepPlan:
    """What one schedule() call has handed out so far."""

    budget: int
    batch_budget: int | None
    prefill_budget: int | None = None  # interactive prefill chunks, when capped
    num_scheduled: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

    def tokens_for(self, request: Request, num_to_go: int) -> int:
        """The most tokens `request` may get, with `num_to_go` left to compute."""
        if request.is_interactive:
            if num_to_go > 1 and self.prefill_budget is not None:
                return min(self.budget, self.prefill_budget)
            return self.budget
        if self.batch_budget is None:
            return self.budget
        return min(self.budget, self.batch_budget)

    def give(self, request: Request, num_tokens: int, num_to_go: int) -> None:
        """Hand `num_tokens` more to `request` (a capped prompt may be given twice)."""
        self.num_scheduled[request.req_id] = self.num_scheduled.get(request.req_id, 0) + num_tokens
        self.budget -= num_tokens
        if not request.is_interactive and self.batch_budget is not None:
            self.batch_budget -= num_tokens
        if request.is_interactive and num_to_go > 1 and self.prefill_budget is not None:
            self.prefill_budget -= num_tokens


def _checked_budget(budget: int | None, name: str = "batch_token_budget") -> int | None:
    if budget is not None and budget < 0:
        raise ValueError(f"{name} must be at least 0, got {budget}")
    return budget


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting = PriorityRequestQueue()
        # Sorted by priority (stable): each class in the order it was admitted.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_req_ids: set[str] = set()
        self.reserve = InteractiveReserve(
            kv_cache_manager.pool.num_blocks,
            window_s=config.interactive_reserve_window_s,
            margin=config.interactive_reserve_margin,
            min_blocks=config.interactive_reserve_min_blocks,
            max_fraction=config.interactive_reserve_max_fraction,
        )
        # For the engine's stats: free blocks batch had to leave in the latest step, and
        # preemptions per priority class since start.
        self.reserve_blocks = 0
        self.num_preemptions_by_priority = {PRIORITY_INTERACTIVE: 0, PRIORITY_BATCH: 0}
        self.num_preemptions = 0
        self.num_steps = 0

    # -- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in the scheduler")
        self.requests[request.req_id] = request
        self.waiting.add(request)

    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        outputs = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(req_id, [], finish_reason="abort"))
        return outputs

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- planning ------------------------------------------------------------------

    def schedule(
        self,
        now: float,
        *,
        batch_token_budget: int | BatchTokenBudget | None = None,
        prefill_token_budget: int | None = None,
    ) -> SchedulerOutput:
        """Plan one step. `batch_token_budget` caps the tokens of all batch requests in
        it (the harvest budget), or is asked for it; interactive requests are never held
        to it. `prefill_token_budget` caps the tokens of interactive requests with more
        than one token to go (prompts), not their decodes."""
        ask = batch_token_budget if callable(batch_token_budget) else None
        given = None if callable(batch_token_budget) else batch_token_budget
        plan = _StepPlan(
            self.config.max_num_batched_tokens,
            _checked_budget(given),
            _checked_budget(prefill_token_budget, "prefill_token_budget"),
        )
        self.reserve_blocks = self.reserve.blocks(now)
        for priority in sorted({r.priority for r in self.running} | set(self.waiting.priorities)):
            if ask is not None and priority > PRIORITY_INTERACTIVE:
                plan.batch_budget = _checked_budget(ask(self._planned_chunks(plan)))
                ask = None
            capped = self._schedule_running(plan, priority)
            # Not in a step that preempted one of this class: the blocks freed go to the
            # running requests first, and the preempted one must not come straight back.
            if all(r.priority != priority for r in plan.preempted):
                self._schedule_waiting(plan, priority)
            self._top_up(plan, capped)
        scheduled = self._commit(plan)
        self.reserve.observe(now, self._num_interactive_blocks())
        finished = frozenset(self._finished_req_ids)
        self._finished_req_ids.clear()
        self.num_steps += 1
        return SchedulerOutput(
            scheduled=scheduled,
            finished_req_ids=finished,
            preempted_req_ids=tuple(r.req_id for r in plan.preempted),
        )

    def _planned_chunks(self, plan: _StepPlan) -> list[tuple[int, int]]:
        """(num_tokens, start_pos) of each request planned so far (not yet committed)."""
        return [(n, self.requests[i].num_computed_tokens) for i, n in plan.num_scheduled.items()]

    def _schedule_running(self, plan: _StepPlan, priority: int) -> list[Request]:
        """Plan the running requests of a class; return the prompts held to the long
        prefill threshold (for _top_up)."""
        cap = self._long_prefill_cap(priority)
        capped = []
        for request in [r for r in self.running if r.priority == priority]:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted for one served before it in this loop
            num_to_go = request.num_tokens - request.num_computed_tokens
            num_new = min(num_to_go, plan.tokens_for(request, num_to_go))
            if num_new == 0:
                if plan.budget == 0:
                    break
                continue  # a capped prompt: the decodes after it still run
            if cap is not None and num_new > cap:
                num_new = cap
                capped.append(request)
            if self._make_room_to_grow(plan, request, num_new):
                plan.give(request, num_new, num_to_go)
        return capped

    def _long_prefill_cap(self, priority: int) -> int | None:
        """The most tokens a running prompt of this class may take before the waiting
        ones are served: the threshold while interactive requests wait, else no cap."""
        threshold = self.config.long_prefill_token_threshold
        if not threshold or priority != PRIORITY_INTERACTIVE or not self.waiting:
            return None
        return threshold if self.waiting.peek().priority == priority else None

    def _top_up(self, plan: _StepPlan, capped: list[Request]) -> None:
        """Give capped prompts what the waiting requests left of the step's budget, as far
        as free blocks allow (no preemption for it: it is only a bigger chunk)."""
        for request in capped:
            given = plan.num_scheduled.get(request.req_id)
            if request.status != RequestStatus.RUNNING or given is None:
                continue
            num_to_go = request.num_tokens - request.num_computed_tokens
            more = min(num_to_go - given, plan.tokens_for(request, num_to_go))
            if more > 0 and self._fits(request, given + more):
                self.kv.allocate_slots(request, given + more)
                plan.give(request, more, num_to_go)

    def _schedule_waiting(self, plan: _StepPlan, priority: int) -> None:
        # Only while the head of the whole queue is of this class: a request never gets
        # in ahead of a more urgent one still waiting.
        while self.waiting and self.waiting.peek().priority == priority:
            request = self.waiting.peek()
            if plan.tokens_for(request, request.num_tokens) == 0:
                return
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_to_go = request.num_tokens - num_cached
            num_new = min(num_to_go, plan.tokens_for(request, num_to_go))
            if num_new == 0:
                return
            if not self._make_room_to_admit(plan, request, num_new, computed_blocks):
                return
            self.kv.allocate_slots(request, num_new, computed_blocks)
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            # At the end of its class: running stays sorted by priority.
            at = bisect.bisect_right(self.running, priority, key=lambda r: r.priority)
            self.running.insert(at, request)
            plan.give(request, num_new, num_to_go)

    def _make_room_to_grow(self, plan: _StepPlan, request: Request, num_new: int) -> bool:
        """Allocate for a running request, preempting others (or itself) when short."""
        while not self._fits(request, num_new):
            victim = self._pick_victim(plan, request, admitting=False)
            assert victim is not None  # the request itself is always a candidate
            if victim is request and self.kv.can_allocate(request, num_new):
                return False  # only the reserve holds it back: keep its blocks and wait
            self._preempt(plan, victim)
            if victim is request:
                return False
        self.kv.allocate_slots(request, num_new)
        return True

    def _make_room_to_admit(
        self,
        plan: _StepPlan,
        request: Request,
        num_new: int,
        computed_blocks: Sequence[KVCacheBlock],
    ) -> bool:
        """Whether a sequence slot and the blocks are there, preempting less urgent
        running requests for them (so only an interactive request preempts batch)."""
        while not (
            len(self.running) < self.config.max_num_seqs
            and self._fits(request, num_new, computed_blocks)
        ):
            victim = self._pick_victim(plan, request, admitting=True)
            if victim is None:
                return False
            self._preempt(plan, victim)
        return True

    def _fits(
        self, request: Request, num_new: int, computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> bool:
        """Whether the blocks are free, leaving the reserve free too for a batch request.

        The reserve is waived for a request with nothing else running beside it: no one
        else would ever free blocks for it. Asking for reserve * block_size more tokens
        is asking for exactly `reserve` more blocks.
        """
        alone = all(r is request for r in self.running)
        keep_free = 0 if request.is_interactive or alone else self.reserve_blocks
        num_tokens = num_new + keep_free * self.kv.block_size
        return self.kv.can_allocate(request, num_tokens, computed_blocks)

    def _pick_victim(self, plan: _StepPlan, request: Request, *, admitting: bool) -> Request | None:
        """Least urgent class first, newest within it; never a more urgent request.

        Candidates are the running requests of less urgent classes and, for a running
        request, those of its own class not yet served this step (itself included).
        """
        candidates = [
            r
            for r in self.running
            if r.priority > request.priority
            or (
                not admitting
                and r.priority == request.priority
                and r.req_id not in plan.num_scheduled
            )
        ]
        return max(candidates, key=lambda r: (r.priority, r.arrival_time), default=None)

    def _preempt(self, plan: _StepPlan, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        by_priority = self.num_preemptions_by_priority
        by_priority[request.priority] = by_priority.get(request.priority, 0) + 1
        self.waiting.prepend(request)
        plan.preempted.append(request)
        logger.debug("preempted %s (priority %d)", request.req_id, request.priority)

    def _commit(self, plan: _StepPlan) -> list[ScheduledRequest]:
        """The planned tokens, in running order, counted as computed from now on."""
        scheduled = []
        for request in self.running:
            num_new = plan.num_scheduled.get(request.req_id)
            if num_new is None:
                continue
            start = request.num_computed_tokens
            scheduled.append(
                ScheduledRequest(
                    req_id=request.req_id,
                    token_ids=request.all_token_ids[start : start + num_new],
                    start_pos=start,
                    block_ids=self.kv.get_block_ids(request.req_id),
                    sample=start + num_new == request.num_tokens,
                    sampling_params=request.sampling_params,
                    output_token_ids=(
                        request.output_token_ids if request.sampling_params.penalized else ()
                    ),
                    prompt_targets=(
                        request.all_token_ids[
                            start + 1 : min(start + num_new + 1, request.num_prompt_tokens)
                        ]
                        if request.wants_prompt_logprobs
                        else ()
                    ),
                )
            )
            # Counted as computed now: the step is committed once planned.
            request.num_computed_tokens += num_new
        return scheduled

    def _num_interactive_blocks(self) -> int:
        """Blocks held by running interactive requests (a shared block counts once)."""
        return len(
            {
                block_id
                for r in self.running
                if r.is_interactive
                for block_id in self.kv.get_block_ids(r.req_id)
            }
        )

    # -- results -------------------------------------------------------------------

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop what is done, and say what each request gained."""
        outputs = []
        finished = []
        for scheduled in scheduler_output.scheduled:
            token_id = runner_output.sampled_token_ids.get(scheduled.req_id)
            request = self.requests.get(scheduled.req_id)
            if request is None:
                continue
            scored = runner_output.prompt_logprobs.get(scheduled.req_id)
            if scored is not None and request.prompt_logprobs is not None:
                first, entries = scored  # by position: a recomputed chunk writes the same
                request.prompt_logprobs[first - 1 : first - 1 + len(entries)] = entries
            if token_id is None:
                continue
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            logprobs = runner_output.logprobs.get(scheduled.req_id)
            output = EngineCoreOutput(
                request.req_id,
                [token_id],
                logprobs=None if logprobs is None else [logprobs],
                num_cached_tokens=request.num_cached_tokens or 0,
            )
            if request.prompt_logprobs is not None:  # the prompt is done: send them once
                assert all(e is not None for e in request.prompt_logprobs)
                output.prompt_logprobs = request.prompt_logprobs  # type: ignore[assignment]
                request.prompt_logprobs = None
            if status is not None:
                finished.append(request)
                self._finish(request, status)
                output.finish_reason = status.finish_reason
                output.stop_token_id = request.stop_token_id
            outputs.append(output)
        if finished:
            done = {r.req_id for r in finished}
            self.running = [r for r in self.running if r.req_id not in done]
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id == request.eos_token_id:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.req_id]
        self._finished_req_ids.add(request.req_id)
