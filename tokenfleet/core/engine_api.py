"""The engine's API: a request in (EngineCoreRequest), a step's progress out (EngineCoreOutputs).

Plain msgspec structs, so the wire codec (engine/wire.py) sends them as they are. The
scheduler's Request is state; these are what callers send and receive. They live in core/
because the scheduler itself makes the outputs.
"""

from __future__ import annotations

import msgspec

from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.errors import InvalidRequestError


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    deadline: float | None = None
    # Prefix-cache isolation (as vLLM's cache_salt): requests share cached blocks only with
    # requests of the same salt (the gateway sends the caller's key group); None: no salt.
    cache_salt: str | None = None
    # A resumed stream (the fleet re-submits a request whose replica died): the tokens an
    # earlier attempt of this request already generated and the caller already received.
    # The engine computes them after the prompt like prompt tokens and samples on from
    # there, with them counted as outputs: in max_tokens (still the original total), in
    # the penalties, and in a seeded request's draw positions, so that the stream goes on
    # as if it never moved. They are not checked for stops nor sent again; logprobs are
    # for the new tokens alone, and a resume may not ask for prompt_logprobs (they came
    # with the first attempt). [] for a first attempt.
    output_token_ids: list[int] = []

    def check_resume(self, vocab: int) -> None:
        """A resumed request (output_token_ids): its earlier outputs are token ids, leave
        max_tokens something to generate, and it asks for no prompt logprobs."""
        earlier = self.output_token_ids
        bad = next((t for t in earlier if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"output_token_ids: token id {bad} is outside the vocabulary [0, {vocab})",
                param="output_token_ids",
            )
        max_tokens = self.sampling_params.max_tokens
        if len(earlier) >= max_tokens:
            raise InvalidRequestError(
                f"the earlier attempt's {len(earlier)} output tokens already reach "
                f"max_tokens ({max_tokens}): a resume has nothing left to generate",
                param="max_tokens",
            )
        if self.sampling_params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt_logprobs cannot be asked for by a resumed request (one with "
                "output_token_ids): they came with its first attempt",
                param="prompt_logprobs",
            )


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The chosen token's logprob and, when asked for, the top-k alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step. finish_reason: "stop", "length", "abort" or
    "error" (the request failed on its own, `error` says how; the engine's other requests
    go on)."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    # With the first output of a request that asked for them: prompt tokens 1, 2, ...
    prompt_logprobs: list[TokenLogprobs] | None = None
    # With finish_reason "error": what failed (its sampling, its output's encoding, ...).
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    # The step-time model (step_model.py): quantiles of recent steps' relative prediction
    # error |predicted - measured| / measured (None before any prediction), and its
    # coefficients, seconds per unit of each term.
    step_time_error_p50: float | None = None
    step_time_error_p99: float | None = None
    step_time_coefficients: dict[str, float] = {}
    # The start-up profile's fit, never refitted (StepTimeModel.profiled); {} without one.
    step_time_profile: dict[str, float] = {}
    # Interactive and batch side by side, keyed "interactive" and "batch": requests
    # running and waiting, and preemptions since start.
    num_running_by_class: dict[str, int] = {}
    num_waiting_by_class: dict[str, int] = {}
    num_preemptions_by_class: dict[str, int] = {}
    # Free KV blocks batch had to leave for interactive arrivals in the latest step.
    num_kv_blocks_reserved_interactive: int = 0
    # The harvest budget (harvest.py) of the latest step that had batch work to plan:
    # batch tokens allowed in it (None before any).
    batch_token_budget: int | None = None
    # The engine's own time to first token (core.py): from the start of the first step
    # after it took a request to the end of the step that gave its first token, summed in
    # seconds and counted, by class, since the engine started.
    ttft_sum_s_by_class: dict[str, float] = {}
    ttft_count_by_class: dict[str, int] = {}
    # The queue as the fleet's router and admission price it (fleet/ttft.py), so that every
    # gateway judges a replica by the same state: each interactive prompt not yet fully
    # computed, its tokens left (running ones first, then waiting, oldest first; at most
    # the first 64), and the running requests past their prompt and the KV tokens they
    # read, by class.
    interactive_prefill_left: list[int] = []
    num_decoding_by_class: dict[str, int] = {}
    decode_kv_tokens_by_class: dict[str, int] = {}


class EngineCoreOutputs(msgspec.Struct):
    """Every request's progress in one engine step: one message per step, not per token."""

    outputs: list[EngineCoreOutput]
    timestamp: float
    stats: SchedulerStats | None = None
