"""EngineCore: one replica's step loop, fed token ids, answering with token ids.

    step(): scheduler.schedule(now) -> model_runner.execute() -> scheduler.update()

With the overlap (EngineConfig.overlap; engine/forward.py) the forward runs on a thread of
its own, and each call plans the next step while the current one runs:

    plan n+1 | wait for n | start n+1 (n's tokens into its placeholders) | update(n)
             [------ forward n ------]  [------------ forward n+1 ------------ ...

so the accelerator waits only for the launch of n+1 (its inputs, the constrained rows'
matchers advanced by n's tokens), not for the planning or n's outputs. A request that
ends in n (a stop token, a complete grammar, an abort) costs n+1 one row, whose token
update() drops (Scheduler: planning ahead); one that ends by length costs none.

The scheduler asks the core for each step's harvest budget once it has planned the
interactive part (harvest.py): batch joins only while the step-time model predicts the
step within the TPOT target.

Requests and aborts arrive between steps; each step returns one EngineCoreOutputs that
lists every request that gained tokens or finished. Everything in and out is plain data
(outputs.py), so the core can sit behind a process boundary.

A constrained request (SamplingParams.constraint) enters the scheduler only once its
constraint is compiled (runner/grammar.py, worker threads): until then it waits in
`compiling` (grammar.CompileWaits), and the steps go on without it. Each step fills the
constrained rows' token masks beside the forward pass and advances their matchers with
the sampled tokens.

(Over 400 lines: admission and the step read the same per-request bookkeeping: the
classes requests came as, their first-token times, the requests waiting for compiles, the
step in flight.)
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import msgspec
import torch

from tokenfleet import envs
from tokenfleet.checkpoint.folder import resolve_model_folder
from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from tokenfleet.core.kv_cache import KVCacheManager
from tokenfleet.core.request import PRIORITY_INTERACTIVE, Request
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.engine.forward import Forwards, Launched, overlap_wanted
from tokenfleet.engine.stats import engine_stats
from tokenfleet.engine.step_profile import profile_step_time
from tokenfleet.errors import ContextLengthError, InvalidRequestError
from tokenfleet.models.config import ModelConfig
from tokenfleet.policy.harvest import PriorityBudgets
from tokenfleet.policy.step_model import (
    StepFeatures,
    StepModelConfig,
    StepTimeModel,
    step_features,
)
from tokenfleet.runner.fixed_runner import FIXED_NUM_BLOCKS, FixedTokenRunner
from tokenfleet.runner.grammar import (
    CompileWaits,
    Compiling,
    ConstraintError,
    GrammarCompiler,
    Matchers,
    PendingFill,
)
from tokenfleet.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self, config: EngineConfig, *, step_model_config: StepModelConfig | None = None
    ) -> None:
        self.config = config
        self.model_folder = resolve_model_folder(config.model)
        model_config = ModelConfig.from_folder(self.model_folder)
        threads = config.num_threads or envs.num_threads()
        if threads:
            torch.set_num_threads(threads)
        max_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
        )
        torch.manual_seed(config.seed)
        self.runner: ModelRunner | FixedTokenRunner
        if config.runner == "fixed":
            # The token "a": text of its own, never EOS.
            token_id = Tokenizer(self.model_folder).encode(" a")[-1]
            self.runner = FixedTokenRunner(
                model_config,
                token_id,
                FIXED_NUM_BLOCKS,
                step_s=config.fixed_step_s,
                prefill_s_per_token=config.fixed_prefill_s_per_token,
            )
        else:
            self.runner = ModelRunner(
                self.model_folder,
                device=config.device,
                dtype=config.dtype,
                cache_config=config.cache,
                max_model_len=max_len,
                seed=config.seed,
                attention_backend=config.attention_backend,
                linear_backend=config.linear_backend,
            )
        self.model_config = self.runner.config
        block_size = config.cache.block_size
        # A request must fit the cache on its own, or it could never be scheduled.
        self.max_model_len = min(max_len, self.runner.num_blocks * block_size)
        self.kv = KVCacheManager(
            self.runner.num_blocks, block_size, enable_caching=config.cache.enable_prefix_caching
        )
        scheduler_config = config.scheduler.under(config.scheduling_policy)
        self.scheduler = Scheduler(
            replace(scheduler_config, max_model_len=self.max_model_len),
            self.kv,
            plan_ahead=overlap_wanted(config),
        )
        self.eos_token_id = (
            self.model_config.eos_token_ids[0] if self.model_config.eos_token_ids else None
        )
        self._pending: list[EngineCoreOutput] = []
        # Constrained decoding: constraints compiled off the step path; the matchers of the
        # admitted constrained requests; those still waiting for their compile, by id. With
        # no compiler (the fixed runner cannot honour a constraint; a tokenizer llguidance
        # cannot read) constrained requests are refused, saying why.
        eos_ids = self.model_config.eos_token_ids
        self.grammar: GrammarCompiler | None = None
        self._no_grammar = "this replica runs the fixed runner, which cannot honour a constraint"
        if isinstance(self.runner, ModelRunner):
            try:
                self.grammar = GrammarCompiler(
                    self.model_folder / "tokenizer.json", self.model_config.vocab_size, eos_ids
                )
            except Exception as exc:  # the model serves all the same, unconstrained
                logger.warning("constrained decoding is off: %s", exc)
                reason = f"this replica cannot compile constraints: its tokenizer: {exc}"
                self._no_grammar = reason[:500]
        self.matchers = Matchers(self.model_config.vocab_size, eos_ids)
        self.compiling = CompileWaits()
        # Predicts a step's runner time (the harvest budget, admission control); profiled
        # now, refitted from every step. The fixed runner does no work worth modelling.
        self.step_model = StepTimeModel(step_model_config)
        if self.step_model.config.profile and isinstance(self.runner, ModelRunner):
            self.profile_step_time()
        # The latest step's predicted runner time (None for an empty step), and the
        # harvest budget of the latest step with batch work to plan (None before any).
        self.last_prediction: float | None = None
        self.last_batch_token_budget: int | None = None
        # Under fcfs every request is scheduled as one class; the ids that came as batch,
        # so that stats (and the batch dispatcher's view of the engine) still count them.
        self.fcfs_batch_ids: set[str] = set()
        # The engine's own time to first token, by the class a request came as: from the
        # start of the first step after it was taken to the end of the step that gave its
        # first token (what the gateway adds is the rest, the engine process's wait for
        # more arrivals included). Requests taken since the last step began; those still
        # waiting for their first token (since when, and the class); sum and count so far.
        self._taken: list[tuple[str, str]] = []
        self._awaiting_first: dict[str, tuple[float, str]] = {}
        self.ttft_sum_s = {"interactive": 0.0, "batch": 0.0}
        self.ttft_count = {"interactive": 0, "batch": 0}
        self.last_step_time = time.monotonic()  # the heartbeat the gateway's health reads
        # The forwards, inline or beside the planning of the next step (the overlap); the
        # step whose forward runs now, planned ahead; the ids of requests ended since the
        # latest forward began, for the next one (the runner forgets them).
        self.forwards = Forwards(self.runner, overlap=overlap_wanted(config))
        self._in_flight: Launched | None = None
        self._unsent_finished: frozenset[str] = frozenset()
        self.num_steps_planned_ahead = 0

    def profile_step_time(self) -> None:
        """Time synthetic steps on the runner (blocks borrowed from the pool and given
        back) and keep them as the step-time model's prior. Run at start-up."""
        began = time.perf_counter()
        samples = profile_step_time(
            self.runner.execute,
            self.kv.pool,
            self.kv.block_size,
            max_num_batched_tokens=self.scheduler.config.max_num_batched_tokens,
            max_num_seqs=self.scheduler.config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_seconds=self.step_model.config.profile_max_s,
        )
        self.step_model.set_prior(samples)
        logger.info(
            "step-time profile: %d steps in %.2f s, coefficients %s",
            len(samples),
            time.perf_counter() - began,
            {k: f"{v:.3g}" for k, v in self.step_model.coefficients.items()},
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validate and queue a request; raises InvalidRequestError naming value and limit."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("prompt must contain at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        bad = next((t for t, _ in request.sampling_params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})",
                param="logit_bias",
            )
        params = request.sampling_params
        if params.seed is not None and not -(2**63) <= params.seed < 2**64:
            # The sampler keys its draws by a 64-bit seed (sampler.seeded_uniform).
            raise InvalidRequestError(
                f"seed {params.seed} is outside [-2**63, 2**64)", param="seed"
            )
        earlier = request.output_token_ids
        if earlier:
            request.check_resume(self.model_config.vocab_size)
        max_tokens = params.max_tokens
        # A resume's earlier outputs are part of max_tokens: prompt + earlier + remaining.
        if len(prompt) + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) is "
                f"{len(prompt) + max_tokens} tokens, over the context length of "
                f"{self.max_model_len}",
                param="max_tokens",
            )
        if request.req_id in self.scheduler.requests or request.req_id in self.compiling:
            raise InvalidRequestError(f"request id {request.req_id!r} is in use", param="req_id")
        if params.constraint is not None and self.grammar is None:
            raise InvalidRequestError(self._no_grammar, param="constraint")
        fcfs = self.config.scheduling_policy == "fcfs"
        interactive = request.priority <= PRIORITY_INTERACTIVE
        scheduled = Request(
            request.req_id,
            prompt,
            request.sampling_params,
            arrival_time=request.arrival_time,
            eos_token_id=self.eos_token_id,
            # FCFS: one class, so arrival order alone decides.
            priority=0 if fcfs else request.priority,
            deadline=request.deadline,
            cache_salt=request.cache_salt,
            output_token_ids=earlier,
        )
        if params.constraint is None or self.grammar is None:
            # Into the scheduler first: should that raise, nothing else holds the request.
            self.scheduler.add_request(scheduled)
        else:
            # Waits out of the scheduler until its matcher exists; a cached compile at once.
            waiting = Compiling(
                scheduled,
                self.grammar.compile(params.constraint),
                time.monotonic() + self.config.grammar_compile_timeout_s,
            )
            if waiting.future.done():
                self._admit(waiting)
            else:
                self.compiling.add(waiting)
        if fcfs and not interactive:
            self.fcfs_batch_ids.add(request.req_id)
        self._taken.append((request.req_id, "interactive" if interactive else "batch"))

    def _admit(self, waiting: Compiling) -> None:
        """A compiled request into the scheduler with its matcher, or ended with the error
        that its constraint's compile, or replaying its earlier outputs, gave."""
        request = waiting.request
        try:
            self.matchers.add(
                request.req_id,
                waiting.future.result(),
                request.sampling_params,
                request.output_token_ids,
            )
        except ConstraintError as exc:
            self._pending.append(self._error(request.req_id, f"constraint: {exc}"))
        except Exception as exc:  # the compile's own failure: this request's alone
            logger.exception("request %s: compiling its constraint failed", request.req_id)
            message = f"constraint: compiling it failed: {type(exc).__name__}: {exc}"
            self._pending.append(self._error(request.req_id, message[:500]))
        else:
            self.scheduler.add_request(request)

    def _admit_compiled(self, now: float) -> None:
        """The waiting requests whose compile ended, in; those past their time limit, out."""
        done, late = self.compiling.take_ended(now)
        for waiting in done:
            self._admit(waiting)
        limit = self.config.grammar_compile_timeout_s
        message = f"constraint: compiling it took over the limit of {limit:g} s"
        self._pending.extend(self._error(req_id, message) for req_id in late)

    @staticmethod
    def _error(req_id: str, message: str) -> EngineCoreOutput:
        return EngineCoreOutput(req_id, [], finish_reason="error", error=message)

    def abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            if self.compiling.pop(req_id) is not None:
                self._pending.append(EngineCoreOutput(req_id, [], finish_reason="abort"))
        self._pending.extend(self.scheduler.abort_requests(req_ids))
        self._forget(req_ids)

    def fail_requests(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """End these requests with an error of their own (finish_reason "error", `error`
        saying why), freeing what they hold; the others go on. A request that finished
        already gets its error output all the same. Returns the outputs to send."""
        ids = list(errors)
        self.scheduler.abort_requests(ids)
        for req_id in ids:
            self.compiling.pop(req_id)
        self._forget(ids)
        return [self._error(req_id, message) for req_id, message in errors.items()]

    def _forget(self, req_ids: list[str]) -> None:
        if self.matchers:
            self.matchers.remove(req_ids)
        self.fcfs_batch_ids.difference_update(req_ids)
        for req_id in req_ids:
            self._awaiting_first.pop(req_id, None)
        if self._taken:
            aborted = set(req_ids)
            self._taken = [t for t in self._taken if t[0] not in aborted]

    def has_unfinished_requests(self) -> bool:
        """Requests not yet finished: in the scheduler, waiting for their compile, or ended
        with an output the next step sends (an abort's, a failed compile's)."""
        return self.scheduler.has_unfinished_requests() or bool(self.compiling or self._pending)

    @property
    def step_in_flight(self) -> bool:
        """Whether a step launched ahead (the overlap) still runs or waits to be taken."""
        return self._in_flight is not None

    def has_pending_outputs(self) -> bool:
        """Abort acknowledgements and errors waiting for the next step's message."""
        return bool(self._pending)

    def has_step_work(self) -> bool:
        """Whether a step now has anything to do: requests in the scheduler, outputs to
        send, or a compile that ended or ran out of time (its request to admit or end).
        False while the only requests wait for compiles: the engine's loop then polls for
        input instead of stepping (step() would wait for them)."""
        if self.scheduler.has_unfinished_requests() or self._pending:
            return True
        return self.compiling.any_ended(time.monotonic())

    def step(self, now: float | None = None) -> EngineCoreOutputs:
        """Run one step to its end and say what its requests gained (and what ended since
        the last step: aborts, errors). With the overlap, the step after it is planned
        while it runs and started as soon as it returns: the forward of that one runs
        while this returns, and the next call waits for it."""
        if self.compiling:
            if not self.scheduler.has_unfinished_requests() and not self._pending:
                # Nothing else to do: wait for the first compile to end (or time out).
                self.compiling.wait_first()
            self._admit_compiled(time.monotonic())
        if self._taken:
            started = time.monotonic()
            for req_id, label in self._taken:
                self._awaiting_first[req_id] = (started, label)
            self._taken = []
        now = time.monotonic() if now is None else now
        current = self._in_flight
        if current is None:
            planned = self._plan(now)
            if planned[0].is_empty:
                self._unsent_finished |= planned[0].finished_req_ids
                return self._outputs(self._pending)
            current = self._launch(self._prepare(planned))
        # Planned, and its inputs made, while `current` runs: its decode rows' tokens are
        # placeholders until `current` gives them.
        ahead = self._plan(now) if self.forwards.overlap else None
        ready = None
        if ahead is not None:
            if ahead[0].is_empty:
                self._unsent_finished |= ahead[0].finished_req_ids
            else:
                ready = self._prepare(ahead)
        runner_output, seconds = current.wait()
        self._in_flight = None
        so = current.so
        # The step planned ahead starts now: a request that ends with `current` costs it a
        # row, dropped. Its constrained rows' masks fill once the matchers have consumed
        # `current`'s tokens (below, beside its forward), without the rows of requests
        # that ended there.
        pending = None
        if ready is not None:
            pending = self._launch_ahead(ready, runner_output)
            self.num_steps_planned_ahead += 1
        completed: set[str] = set()
        try:
            if current.masks is not None:
                completed, rejected = self.matchers.advance(
                    runner_output.sampled_token_ids, current.masks.req_ids
                )
                if rejected:  # no token for them: they end with the error below
                    sampled = runner_output.sampled_token_ids
                    runner_output = msgspec.structs.replace(
                        runner_output,
                        sampled_token_ids={k: v for k, v in sampled.items() if k not in rejected},
                        failed={**runner_output.failed, **rejected},
                    )
        except BaseException as exc:
            if pending is not None:
                pending.fail(exc)  # the forward waits for its masks: never leave it waiting
            raise
        if pending is not None:
            pending.start(completed.union(runner_output.failed))
        # What follows runs beside that forward.
        self.step_model.observe(current.features, seconds)
        outputs = self._pending + self.scheduler.update(so, runner_output, completed)
        if self.matchers:
            self.matchers.remove([o.req_id for o in outputs if o.finished])
        failed = runner_output.failed
        if failed:  # gained no token this step (update passed them over): ended here
            live = {r.req_id for r in so.requests if r.req_id in failed and not r.status.finished}
            outputs += self.fail_requests({k: v for k, v in failed.items() if k in live})
        return self._outputs(outputs)

    def _plan(self, now: float) -> tuple[SchedulerOutput, StepFeatures]:
        """The next step's plan (committed: it runs) and its features; sets its predicted
        runner time (None for an empty step)."""
        if self.config.scheduling_policy == "priority":
            budgets = PriorityBudgets.from_config(
                self.scheduler, self.step_model, self.config, self.step_model.profiled
            )
            so = budgets.schedule(now)
            if budgets.last_batch_budget is not None:
                self.last_batch_token_budget = budgets.last_batch_budget
        else:
            so = self.scheduler.schedule(now)
        features = step_features(so)
        self.last_prediction = None if so.is_empty else self.step_model.predict(features)
        return so, features

    def _prepare(
        self, planned: tuple[SchedulerOutput, StepFeatures]
    ) -> tuple[SchedulerOutput, StepFeatures, Any]:
        """A planned step with its inputs made (the runner's prepare)."""
        so, features = planned
        if self._unsent_finished:  # ended in steps that ran no forward: the runner forgets them
            so = replace(so, finished_req_ids=so.finished_req_ids | self._unsent_finished)
            self._unsent_finished = frozenset()
        return so, features, self.forwards.prepare(so)

    def _launch(self, ready: tuple[SchedulerOutput, StepFeatures, Any]) -> Launched:
        """Start a prepared step's forward, its constrained rows' masks filling in a thread
        beside it."""
        so, features, inputs = ready
        masks = self.matchers.start_fill(so) if self.matchers else None
        return self.forwards.launch(so, inputs, masks, features)

    def _launch_ahead(
        self, ready: tuple[SchedulerOutput, StepFeatures, Any], done: ModelRunnerOutput
    ) -> PendingFill | None:
        """Start the forward of a step planned ahead of the one that gave `done`: its
        placeholders filled from that step's tokens, its masks (none for rows of requests
        that failed there) to be filled once the matchers have consumed them: the
        PendingFill to start then."""
        so, features, inputs = ready
        self.runner.fill_placeholders(inputs, done.sampled_token_ids)
        pending = self.matchers.fill_later(so, done.failed) if self.matchers else None
        masks = None if pending is None else pending.masks
        self._in_flight = self.forwards.launch(so, inputs, masks, features)
        return pending

    def _outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        if self.fcfs_batch_ids:
            self.fcfs_batch_ids.difference_update(o.req_id for o in outputs if o.finished)
        self._pending = []
        self.last_step_time = time.monotonic()
        if self._awaiting_first:
            self._record_first_tokens(outputs, self.last_step_time)
        return EngineCoreOutputs(outputs, timestamp=time.time(), stats=self.stats())

    def close(self) -> None:
        """Wait for a forward still running, and stop its thread."""
        self.forwards.close()

    def _record_first_tokens(self, outputs: list[EngineCoreOutput], now: float) -> None:
        awaiting = self._awaiting_first
        for output in outputs:
            if output.new_token_ids or output.finished:
                taken = awaiting.pop(output.req_id, None)
                if taken is not None and output.new_token_ids:
                    self.ttft_sum_s[taken[1]] += now - taken[0]
                    self.ttft_count[taken[1]] += 1

    def stats(self) -> SchedulerStats:
        return engine_stats(self)
