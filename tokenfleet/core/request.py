"""A request's scheduling state inside one engine replica.

Not a wire message: what crosses process boundaries lives in `outputs.py`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenfleet.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenfleet.core.engine_api import TokenLogprobs

# Priority classes: lower is more urgent. The gateway sends interactive traffic as 0 and
# batch work as 1; the scheduler treats every class above PRIORITY_INTERACTIVE as batch.
PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 1

# The token id that holds the place of a token being sampled by a step still running (the
# engine's overlap: the next step is planned before the current one's tokens are known).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


# A tuple: `in` compares by identity, where a set would call Enum's __hash__ (Python code,
# once a request a step in update()).
_FINISHED = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
)
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Prompt and output token ids plus how far the KV cache has caught up with them.

    `num_computed_tokens` counts tokens whose K/V are in the cache (or are being written
    by the step just scheduled). A step gives a request `num_tokens - num_computed_tokens`
    tokens at most: the whole prompt (prefill), part of it (chunked prefill), or the one
    token sampled last (decode) are all that one rule. A resumed request
    (EngineCoreRequest.output_token_ids) has outputs from the start: its prefill runs
    past num_prompt_tokens, over them, up to the first token it samples.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float,
        eos_token_id: int | None = None,
        priority: int = 0,
        deadline: float | None = None,
        cache_salt: str | None = None,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        self.req_id = req_id
        # Salts the first block's hash: prefix-cache hits only among requests of one salt.
        self.cache_salt = cache_salt
        self.sampling_params = sampling_params
        # Whether the sampler needs the outputs so far: for the penalties, and their count
        # for a seeded draw (keyed by the output position, earlier attempts' included).
        self.sampling_needs_outputs = sampling_params.penalized or (
            sampling_params.seed is not None and not sampling_params.greedy
        )
        self.arrival_time = arrival_time
        self.eos_token_id = eos_token_id
        # Lower value = more urgent: PRIORITY_INTERACTIVE or PRIORITY_BATCH.
        self.priority = priority
        # An attribute, not a property: the scheduler asks it several times a request a
        # step. Both change together, only through set_priority.
        self.is_interactive = priority <= PRIORITY_INTERACTIVE
        self.deadline = deadline
        self.num_prompt_tokens = len(prompt_token_ids)
        # A resumed request starts with its earlier attempt's outputs: computed like the
        # prompt (a prefill over both), counted as outputs.
        self.all_token_ids: list[int] = [*prompt_token_ids, *output_token_ids]
        self.num_computed_tokens = 0
        # Trailing PLACEHOLDERs in all_token_ids: tokens that steps still running sample
        # (the engine's overlap; 0 otherwise). Each step's result fills the first.
        self.num_placeholders = 0
        self.status = RequestStatus.WAITING
        self.stop_token_id: int | None = None
        self.num_preemptions = 0
        # Of the blocks it holds, how many the runner has been sent (SchedulerOutput sends
        # only the new ones); 0 once they are freed (preempted: sent whole again).
        self.num_blocks_sent = 0
        # Prompt tokens served from the prefix cache at first admission (for usage stats).
        self.num_cached_tokens: int | None = None
        # Chained hashes of the full blocks of all_token_ids, filled by the KV manager.
        self.block_hashes: list[int] = []
        # With sampling_params.prompt_logprobs: entry p - 1 is prompt token p's logprob,
        # filled as the prompt's chunks are computed, sent with the first output.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * (self.num_prompt_tokens - 1)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the prompt's logprobs are still to be computed and sent: its chunks
        then need logits for every token, and the prefix cache may not skip any."""
        return self.prompt_logprobs is not None

    def set_priority(self, priority: int) -> None:
        """A new priority class, before the request reaches a scheduler."""
        self.priority = priority
        self.is_interactive = priority <= PRIORITY_INTERACTIVE

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known: num_tokens less the placeholders."""
        return len(self.all_token_ids) - self.num_placeholders

    def append_output_token(self, token_id: int) -> None:
        """The next output token: in the first placeholder's place, if there is one."""
        if self.num_placeholders:
            self.all_token_ids[-self.num_placeholders] = token_id
            self.num_placeholders -= 1
        else:
            self.all_token_ids.append(token_id)

    def add_placeholder(self) -> None:
        """A token that a step still running samples, appended before it is known."""
        self.all_token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def retract_placeholder(self) -> None:
        """The first placeholder taken back: its step gave the request no token."""
        del self.all_token_ids[-self.num_placeholders]
        self.num_placeholders -= 1

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
