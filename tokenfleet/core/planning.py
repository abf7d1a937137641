"""The step's token split: which requests advance in a step, and by how many tokens.

The one home of the rule: the Scheduler plans every step with it, over its KV cache, and
admission replays it on lengths alone (LengthPlanner) to predict a time to first token.

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
prefix.

StepPlanner holds the rule, the KV cache behind hooks (_fits, _allocate, ...) that the
Scheduler implements; their defaults, a cache that never runs short and never hits, are
what LengthPlanner, the replay on lengths alone, plans over. (Over 400 lines: the rule,
moved whole from scheduler.py, and its replay are read together.)
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

from tokenfleet.config import SchedulerConfig
from tokenfleet.core.block_pool import KVCacheBlock
from tokenfleet.core.request import PRIORITY_INTERACTIVE, Request, RequestStatus
from tokenfleet.core.request_queue import PriorityRequestQueue
from tokenfleet.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Asked once per step, after the interactive classes are planned, with their chunks as
# (num_tokens, start_pos): the step's batch token budget.
BatchTokenBudget = Callable[[list[tuple[int, int]]], int]


def _checked_budget(budget: int | None, name: str = "batch_token_budget") -> int | None:
    if budget is not None and budget < 0:
        raise ValueError(f"{name} must be at least 0, got {budget}")
    return budget


@dataclass
class StepPlan:
    """What one step's planning has handed out so far."""

    budget: int
    batch_budget: int | None
    prefill_budget: int | None = None  # interactive prefill chunks, when capped
    num_scheduled: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

    @classmethod
    def begin(
        cls,
        max_num_batched_tokens: int,
        batch_token_budget: int | BatchTokenBudget | None,
        prefill_token_budget: int | None,
    ) -> tuple[StepPlan, BatchTokenBudget | None]:
        """An empty plan, and the batch budget's question when it is asked (a callable)."""
        ask = batch_token_budget if callable(batch_token_budget) else None
        given = None if callable(batch_token_budget) else batch_token_budget
        plan = cls(
            max_num_batched_tokens,
            _checked_budget(given),
            _checked_budget(prefill_token_budget, "prefill_token_budget"),
        )
        return plan, ask

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
        scheduled = self.num_scheduled
        scheduled[request.req_id] = scheduled.get(request.req_id, 0) + num_tokens
        self.budget -= num_tokens
        if request.is_interactive:
            if num_to_go > 1 and self.prefill_budget is not None:
                self.prefill_budget -= num_tokens
        elif self.batch_budget is not None:
            self.batch_budget -= num_tokens


class StepPlanner:
    """The token split of a step (the module's rule) over `running` and `waiting`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting = PriorityRequestQueue()
        # Sorted by priority (stable): each class in the order it was admitted.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    def plan_step(self, plan: StepPlan, ask: BatchTokenBudget | None) -> None:
        """Fill `plan` class by class; `ask` is asked for the batch budget before the
        first batch class."""
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

    def _planned_chunks(self, plan: StepPlan) -> list[tuple[int, int]]:
        """(num_tokens, start_pos) of each request planned so far (not yet committed)."""
        return [(n, self.requests[i].num_computed_tokens) for i, n in plan.num_scheduled.items()]

    def _schedule_running(self, plan: StepPlan, priority: int) -> list[Request]:
        """Plan the running requests of a class; return the prompts held to the long
        prefill threshold (for _top_up)."""
        cap = self._long_prefill_cap(priority)
        capped = []
        # Once a request a step: the names looked up once, not in each turn.
        running_status = RequestStatus.RUNNING
        tokens_for, give, grow = plan.tokens_for, plan.give, self._make_room_to_grow
        for request in [r for r in self.running if r.priority == priority]:
            if request.status is not running_status:
                continue  # preempted for one served before it in this loop
            if request.num_placeholders and self._ends_in_flight(request):
                continue  # a step still running samples its last token
            num_to_go = request.num_tokens - request.num_computed_tokens
            num_new = tokens_for(request, num_to_go)
            if num_to_go < num_new:
                num_new = num_to_go
            if num_new == 0:
                if plan.budget == 0:
                    break
                continue  # a capped prompt: the decodes after it still run
            if cap is not None and num_new > cap:
                num_new = cap
                capped.append(request)
            if grow(plan, request, num_new):
                give(request, num_new, num_to_go)
        return capped

    def _long_prefill_cap(self, priority: int) -> int | None:
        """The most tokens a running prompt of this class may take before the waiting
        ones are served: the threshold while interactive requests wait, else no cap."""
        threshold = self.config.long_prefill_token_threshold
        if not threshold or priority != PRIORITY_INTERACTIVE or not self.waiting:
            return None
        return threshold if self.waiting.peek().priority == priority else None

    def _top_up(self, plan: StepPlan, capped: list[Request]) -> None:
        """Give capped prompts what the waiting requests left of the step's budget, as far
        as free blocks allow (no preemption for it: it is only a bigger chunk)."""
        for request in capped:
            given = plan.num_scheduled.get(request.req_id)
            if request.status != RequestStatus.RUNNING or given is None:
                continue
            num_to_go = request.num_tokens - request.num_computed_tokens
            more = min(num_to_go - given, plan.tokens_for(request, num_to_go))
            if more > 0 and self._fits(request, given + more):
                self._allocate(request, given + more)
                plan.give(request, more, num_to_go)

    def _schedule_waiting(self, plan: StepPlan, priority: int) -> None:
        # Only while the head of the whole queue is of this class: a request never gets
        # in ahead of a more urgent one still waiting.
        while self.waiting and self.waiting.peek().priority == priority:
            request = self.waiting.peek()
            if plan.tokens_for(request, request.num_tokens) == 0:
                return
            computed_blocks, num_cached = self._computed_blocks(request)
            num_to_go = request.num_tokens - num_cached
            num_new = min(num_to_go, plan.tokens_for(request, num_to_go))
            if num_new == 0:
                return
            if not self._make_room_to_admit(plan, request, num_new, computed_blocks):
                return
            self._allocate(request, num_new, computed_blocks)
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:
                # Prompt tokens alone: a resumed request's hits may run on over the
                # outputs of its earlier attempt, which usage does not count as prompt.
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            # At the end of its class: running stays sorted by priority.
            at = bisect.bisect_right(self.running, priority, key=lambda r: r.priority)
            self.running.insert(at, request)
            plan.give(request, num_new, num_to_go)

    def _make_room_to_grow(self, plan: StepPlan, request: Request, num_new: int) -> bool:
        """Allocate for a running request, preempting others (or itself) when short."""
        while not self._fits(request, num_new):
            victim = self._pick_victim(plan, request, admitting=False)
            assert victim is not None  # the request itself is always a candidate
            if victim is request and self._can_allocate(request, num_new):
                return False  # only the reserve holds it back: keep its blocks and wait
            self._preempt(plan, victim)
            if victim is request:
                return False
        self._allocate(request, num_new)
        return True

    def _make_room_to_admit(
        self,
        plan: StepPlan,
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

    def _pick_victim(self, plan: StepPlan, request: Request, *, admitting: bool) -> Request | None:
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

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether a request with tokens still being sampled (placeholders: the Scheduler
        planning ahead) reaches its end with them. Here, never."""
        return False

    def _preempt(self, plan: StepPlan, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.prepend(request)
        plan.preempted.append(request)
        logger.debug("preempted %s (priority %d)", request.req_id, request.priority)

    # -- the KV cache: one that never runs short and never hits (the Scheduler's is real)

    def _fits(
        self, request: Request, num_new: int, computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> bool:
        """Whether the blocks for `num_new` more tokens are free (reserve included)."""
        return True

    def _can_allocate(self, request: Request, num_new: int) -> bool:
        """Whether they are, not counting the interactive reserve."""
        return True

    def _allocate(
        self, request: Request, num_new: int, computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> None:
        """Take the blocks for `num_new` more tokens."""

    def _computed_blocks(self, request: Request) -> tuple[Sequence[KVCacheBlock], int]:
        """The cached blocks of a waiting request's prefix, and their tokens."""
        return (), 0

    def _free(self, request: Request) -> None:
        """Give back a preempted request's blocks."""


# -- the replay on lengths alone ---------------------------------------------------------

_PARAMS = SamplingParams()


class LengthRequest(Request):
    """A request known by its lengths alone (no token ids): what a replay plans."""

    num_tokens = 0  # an attribute here, not Request's count of its token ids

    def __init__(
        self,
        req_id: str,
        num_tokens: int,
        *,
        num_computed_tokens: int = 0,
        num_prompt_tokens: int | None = None,
        priority: int = PRIORITY_INTERACTIVE,
        arrival_time: float = 0.0,
    ) -> None:
        super().__init__(req_id, [], _PARAMS, arrival_time=arrival_time, priority=priority)
        self.num_tokens = num_tokens
        self.num_prompt_tokens = num_tokens if num_prompt_tokens is None else num_prompt_tokens
        self.num_computed_tokens = num_computed_tokens

    @property
    def decoding(self) -> bool:
        """Past its prompt, with one token (the one sampled last) to go."""
        return (
            self.num_computed_tokens >= self.num_prompt_tokens
            and self.num_tokens - self.num_computed_tokens == 1
        )


class Chunk(NamedTuple):
    """One request's share of a planned step, as its tokens stood before it."""

    request: LengthRequest
    num_tokens: int
    start_pos: int
    num_to_go: int

    @property
    def is_decode(self) -> bool:
        """A decode of a request past its prompt (not a prompt's last token)."""
        return self.num_to_go == 1 and self.start_pos >= self.request.num_prompt_tokens


_new_chunk = tuple.__new__


class LengthPlanner(StepPlanner):
    """StepPlanner over lengths alone, on a cache that never runs short and never hits:
    each step is planned as the Scheduler would, then committed as if run, every request
    that reaches its end sampling one token and none ever finishing."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.last_preempted: list[Request] = []  # by the latest step

    def add(
        self,
        req_id: str,
        num_tokens: int,
        *,
        running: bool,
        num_computed_tokens: int = 0,
        num_prompt_tokens: int | None = None,
        priority: int = PRIORITY_INTERACTIVE,
        arrival_time: float | None = None,
    ) -> LengthRequest:
        """Add a request at the end of the running list (in its order, with its progress)
        or of its class's waiting queue (pop order); arrival order = add order unless
        `arrival_time` says otherwise."""
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already planned")
        request = LengthRequest(
            req_id,
            num_tokens,
            num_computed_tokens=num_computed_tokens if running else 0,
            num_prompt_tokens=num_prompt_tokens,
            priority=priority,
            arrival_time=float(len(self.requests)) if arrival_time is None else arrival_time,
        )
        self.requests[req_id] = request
        if running:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            self.waiting.add(request)
        return request

    def step(
        self,
        *,
        batch_token_budget: int | BatchTokenBudget | None = None,
        prefill_token_budget: int | None = None,
    ) -> list[Chunk]:
        """Plan a step (Scheduler.schedule's budgets) and commit it: its chunks, in
        running order."""
        plan, ask = StepPlan.begin(
            self.config.max_num_batched_tokens, batch_token_budget, prefill_token_budget
        )
        self.plan_step(plan, ask)
        self.last_preempted = plan.preempted
        chunks: list[Chunk] = []
        scheduled = plan.num_scheduled
        for planned in self.running:
            num_new = scheduled.get(planned.req_id)
            if num_new is None:
                continue
            request = cast(LengthRequest, planned)
            start = request.num_computed_tokens
            num_tokens = request.num_tokens
            # Chunk(...) without its Python-level __new__: a request a step, every step.
            chunks.append(_new_chunk(Chunk, (request, num_new, start, num_tokens - start)))
            request.num_computed_tokens = start + num_new
            if start + num_new == num_tokens:  # sampled: one more token
                request.num_tokens = num_tokens + 1
        return chunks

    def repeat(self, chunks: Sequence[Chunk], times: int) -> None:
        """Commit the step of `chunks` (committed once already) `times` more times: a
        decode decodes `times` more tokens, a prompt chunk is taken again as often (the
        caller keeps it within the prompt)."""
        for chunk in chunks:
            request = chunk.request
            if chunk.is_decode:  # `times` more: one computed, one sampled in each
                request.num_computed_tokens += times
                request.num_tokens += times
            else:
                request.num_computed_tokens += chunk.num_tokens * times
                if request.num_computed_tokens == request.num_tokens:
                    request.num_tokens += 1
