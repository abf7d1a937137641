"""What the runner hands back to the scheduler for one step, in process (never on the wire)."""

from __future__ import annotations

import msgspec

from tokenfleet.core.engine_api import TokenLogprobs


class ModelRunnerOutput(msgspec.Struct):
    """The runner's answer to one SchedulerOutput: one sampled token per sampling request."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = {}
    # req_id -> (position of the first prompt token scored, the entries from there on)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    # req_id -> why: requests that failed on their own in this step (their sampling, say),
    # left out of the fields above; the engine ends them with that error.
    failed: dict[str, str] = {}
