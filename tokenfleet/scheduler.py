"""The step planner: which requests advance this step, and by how many tokens.

One rule covers prefill, chunked prefill and decode: a request is given tokens until its
num_computed_tokens catches up with num_tokens, within max_num_batched_tokens and
max_num_seqs. Running requests are served first, in order, so a long prompt arriving
never stalls decodes; when blocks run out the victim (the newest request) is preempted
and recomputed later, mostly from its still-cached prefix. Time is passed in.
"""

from __future__ import annotations

import logging

from tokenfleet.config import SchedulerConfig
from tokenfleet.kv_cache import KVCacheManager
from tokenfleet.outputs import EngineCoreOutput, ModelRunnerOutput
from tokenfleet.request import Request, RequestStatus
from tokenfleet.request_queue import FCFSRequestQueue
from tokenfleet.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting = FCFSRequestQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_req_ids: set[str] = set()
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

    def schedule(self, now: float) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        preempted: list[Request] = []

        # 1. Running requests, in order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim(self.running[i:])
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # it was its own victim; the list shifted onto the next one
            num_scheduled[request.req_id] = num_new
            budget -= num_new
            i += 1

        # 2. Waiting requests, while budget, sequence slots and blocks last. Not in a
        #    step that had to preempt: the freed blocks go to the running ones first.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            self.running.append(request)
            num_scheduled[request.req_id] = num_new
            budget -= num_new

        scheduled = []
        for request in self.running:
            if request.req_id not in num_scheduled:
                continue
            num_new = num_scheduled[request.req_id]
            start = request.num_computed_tokens
            scheduled.append(
                ScheduledRequest(
                    req_id=request.req_id,
                    token_ids=request.all_token_ids[start : start + num_new],
                    start_pos=start,
                    block_ids=self.kv.get_block_ids(request.req_id),
                    sample=start + num_new == request.num_tokens,
                    sampling_params=request.sampling_params,
                )
            )
            # Counted as computed now: the step is committed once planned.
            request.num_computed_tokens += num_new

        finished = frozenset(self._finished_req_ids)
        self._finished_req_ids.clear()
        self.num_steps += 1
        return SchedulerOutput(
            scheduled=scheduled,
            finished_req_ids=finished,
            preempted_req_ids=tuple(r.req_id for r in preempted),
        )

    def _pick_victim(self, candidates: list[Request]) -> Request:
        """The seam for priority classes: least important, then newest, goes first."""
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        logger.debug("preempted %s", request.req_id)

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
            if token_id is None or request is None:
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
