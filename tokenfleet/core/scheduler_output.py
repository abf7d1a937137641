"""SchedulerOutput: the only thing that crosses from the scheduler to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from tokenfleet.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenfleet.core.request import Request


class ScheduledRequest(NamedTuple):
    """One request's share of a step (a tuple: one is made a running request a step, at a
    third of a frozen dataclass's cost).

    The runner feeds `token_ids` at positions start_pos, start_pos+1, ...; their K/V go to
    the slots that the request's block table gives those positions. Only what changed
    crosses: `new_block_ids` are the blocks it took since its previous step, which the
    runner appends to the table it keeps (runner/block_tables.py), or, with `new_table`
    (its first step since it was admitted, or resumed after a preemption), its whole
    table. When `sample` is set, this step reaches the request's last token and the
    runner samples the next one.
    `output_token_ids`: the tokens it has generated so far (an earlier attempt's
    included), given only on the chunk that samples and only when its sampling needs them
    (penalties; a seeded draw's position is their count), else empty.
    `prompt_targets`: for a chunk of a prompt whose logprobs are wanted, the prompt
    tokens at positions start_pos + 1, ... that its rows predict (up to the prompt's end),
    else empty.
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    new_block_ids: list[int]
    new_table: bool
    sample: bool
    sampling_params: SamplingParams
    output_token_ids: list[int] | tuple[()] = ()
    prompt_targets: list[int] | tuple[()] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests finished, aborted or preempted since the previous step: the runner drops
    # per-request state for the finished ones.
    finished_req_ids: frozenset[str]
    preempted_req_ids: tuple[str, ...]
    # The scheduler's own: the request of each scheduled row, in order, for update() (by
    # object, not id: an id ended and reused while a step ran is another request). The
    # runner never reads it.
    requests: tuple[Request, ...] = field(default=(), compare=False, repr=False)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.req_id: s.num_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
