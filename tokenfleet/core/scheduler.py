"""The scheduler: requests in and out, each step planned over the KV cache, results back.

The step's token split (which requests advance, by how many tokens, and who is preempted
when blocks or sequence slots run out) is planning.py's rule, shared with admission's
replay; the Scheduler gives it the KV cache (the hooks below: blocks, the interactive
reserve, prefix hits), commits the plan into a SchedulerOutput, and applies the sampled
tokens. Time is passed in.

Planning ahead (`plan_ahead`, the engine's overlap): the next step may be planned while
the current one runs, before its tokens are known. A row that samples then leaves a
PLACEHOLDER token (request.py) at commit, which the next plan schedules as that request's
decode (the engine fills its id in when the current step returns) and the step's result
replaces. A request whose tokens in flight reach max_tokens or the context length is not
planned again (it ends by length when they land); one that ends otherwise (a stop token,
a complete grammar, an abort) costs the step planned ahead one row, whose token update()
then drops. Off, schedule() and update() alternate and no placeholder is ever made.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tokenfleet.config import SchedulerConfig
from tokenfleet.core.block_pool import KVCacheBlock
from tokenfleet.core.engine_api import EngineCoreOutput
from tokenfleet.core.kv_cache import HeldBlocks, KVCacheManager
from tokenfleet.core.planning import BatchTokenBudget, StepPlan, StepPlanner
from tokenfleet.core.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE, Request, RequestStatus
from tokenfleet.core.reserve import InteractiveReserve
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.scheduler_output import ScheduledRequest, SchedulerOutput


class Scheduler(StepPlanner):
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        plan_ahead: bool = False,
    ) -> None:
        super().__init__(config)
        self.kv = kv_cache_manager
        self.plan_ahead = plan_ahead
        self._finished_req_ids: set[str] = set()
        self._interactive_blocks = HeldBlocks()  # counted at each step for the reserve
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
        # Rows of steps planned ahead whose requests ended before the step did (their
        # tokens dropped): at most one a request.
        self.num_rows_dropped = 0

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
        plan, ask = StepPlan.begin(
            self.config.max_num_batched_tokens, batch_token_budget, prefill_token_budget
        )
        self.reserve_blocks = self.reserve.blocks(now)
        self.plan_step(plan, ask)
        scheduled, requests = self._commit(plan)
        self.reserve.observe(now, self._num_interactive_blocks())
        finished = frozenset(self._finished_req_ids)
        self._finished_req_ids.clear()
        self.num_steps += 1
        return SchedulerOutput(
            scheduled=scheduled,
            finished_req_ids=finished,
            preempted_req_ids=tuple(r.req_id for r in plan.preempted),
            requests=requests,
        )

    # -- the KV cache, as planning.py's rule asks about it -----------------------------

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

    def _make_room_to_grow(self, plan: StepPlan, request: Request, num_new: int) -> bool:
        """The rule's own, with a shortcut for what most rows of a busy step are: tokens
        that fit in the blocks the request holds, with the reserve left free (_fits's
        test, counted on the spot)."""
        # Alone: it is running, the only one.
        keep_free = 0 if request.is_interactive or len(self.running) == 1 else self.reserve_blocks
        if self.kv.grow_in_place(request, num_new, keep_free):
            return True
        return super()._make_room_to_grow(plan, request, num_new)

    def _can_allocate(self, request: Request, num_new: int) -> bool:
        return self.kv.can_allocate(request, num_new)

    def _allocate(
        self, request: Request, num_new: int, computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> None:
        self.kv.allocate_slots(request, num_new, computed_blocks)

    def _computed_blocks(self, request: Request) -> tuple[Sequence[KVCacheBlock], int]:
        return self.kv.get_computed_blocks(request)

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        request.num_blocks_sent = 0

    def _preempt(self, plan: StepPlan, request: Request) -> None:
        super()._preempt(plan, request)
        self.num_preemptions += 1
        by_priority = self.num_preemptions_by_priority
        by_priority[request.priority] = by_priority.get(request.priority, 0) + 1

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether the tokens of steps still running take the request to its max_tokens or
        the context length: it ends by length when they land, and is not planned again."""
        return (
            request.num_output_tokens >= request.sampling_params.max_tokens
            or request.num_tokens >= self.config.max_model_len
        )

    def _commit(self, plan: StepPlan) -> tuple[list[ScheduledRequest], tuple[Request, ...]]:
        """The planned tokens, in running order, counted as computed from now on; and the
        requests they are of, in the same order."""
        scheduled = []
        requests = []
        plan_ahead = self.plan_ahead
        req_to_blocks = self.kv.req_to_blocks
        num_scheduled = plan.num_scheduled
        for request in self.running:
            req_id = request.req_id
            num_new = num_scheduled.get(req_id)
            if num_new is None:
                continue
            start = request.num_computed_tokens
            params = request.sampling_params
            token_ids = request.all_token_ids
            sample = start + num_new == len(token_ids)
            blocks = req_to_blocks[req_id]
            num_sent = request.num_blocks_sent
            num_blocks = len(blocks)
            request.num_blocks_sent = num_blocks
            # By position, in the fields' order (keywords cost twice as much, once a request
            # a step).
            scheduled.append(
                ScheduledRequest(
                    req_id,
                    token_ids[start : start + num_new],
                    start,  # start_pos
                    # new_block_ids, new_table:
                    [b.block_id for b in blocks[num_sent:]] if num_blocks > num_sent else [],
                    num_sent == 0,
                    sample,
                    params,
                    # output_token_ids:
                    request.output_token_ids if sample and request.sampling_needs_outputs else (),
                    # prompt_targets:
                    token_ids[start + 1 : min(start + num_new + 1, request.num_prompt_tokens)]
                    if request.prompt_logprobs is not None  # wants_prompt_logprobs
                    else (),
                )
            )
            requests.append(request)
            # Counted as computed now: the step is committed once planned.
            request.num_computed_tokens += num_new
            if sample and plan_ahead:
                request.add_placeholder()
        return scheduled, tuple(requests)

    def _num_interactive_blocks(self) -> int:
        """Blocks held by running interactive requests (a shared block counts once)."""
        req_to_blocks = self.kv.req_to_blocks
        lists = {
            r.req_id: blocks
            for r in self.running
            if r.is_interactive and (blocks := req_to_blocks.get(r.req_id)) is not None
        }
        return self._interactive_blocks.count(lists)

    # -- results -------------------------------------------------------------------

    def update(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        completed: Collection[str] = (),
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop what is done, and say what each request gained.
        `completed`: requests whose constraint is complete with this step's token (their
        grammar allows nothing more): they end with "stop"."""
        outputs = []
        finished = []
        sampled = runner_output.sampled_token_ids
        all_logprobs = runner_output.logprobs
        all_prompt_logprobs = runner_output.prompt_logprobs
        check_stop = self._check_stop
        for scheduled, request in zip(
            scheduler_output.scheduled, scheduler_output.requests, strict=True
        ):
            if request.status.finished:  # ended since (planned ahead, aborted): dropped
                self.num_rows_dropped += 1
                continue
            req_id = request.req_id
            token_id = sampled.get(req_id)
            if token_id is None and scheduled.sample and request.num_placeholders:
                request.retract_placeholder()
            if all_prompt_logprobs:
                scored = all_prompt_logprobs.get(req_id)
                if scored is not None and request.prompt_logprobs is not None:
                    first, entries = scored  # by position: a recomputed chunk writes the same
                    request.prompt_logprobs[first - 1 : first - 1 + len(entries)] = entries
            if token_id is None:
                continue
            request.append_output_token(token_id)
            status = check_stop(request, token_id, req_id in completed)
            logprobs = all_logprobs.get(req_id) if all_logprobs else None
            output = EngineCoreOutput(
                req_id,
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
                if request.status == RequestStatus.PREEMPTED:  # by a plan made ahead
                    self.waiting.remove(request)
                self._finish(request, status)
                output.finish_reason = status.finish_reason
                output.stop_token_id = request.stop_token_id
            outputs.append(output)
        if finished:
            done = {r.req_id for r in finished}
            self.running = [r for r in self.running if r.req_id not in done]
        return outputs

    def _check_stop(
        self, request: Request, token_id: int, completed: bool = False
    ) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id == request.eos_token_id:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if completed:  # before length: the output is whole even at its last allowed token
            if token_id == request.eos_token_id:  # EOS ended the grammar under ignore_eos
                request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        # Known tokens: those of steps still running are not the request's yet.
        num_known = request.num_known_tokens
        if num_known - request.num_prompt_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if num_known >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._free(request)
        del self.requests[request.req_id]
        self._finished_req_ids.add(request.req_id)
