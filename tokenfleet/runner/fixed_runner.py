"""FixedTokenRunner: answers every step without running a model, for plumbing tests at a
scale the real model cannot reach in CI (a 100,000-request batch, say).

Every sampled token is the same fixed token id, so outputs are known in advance; the
scheduler, KV manager, engine process, gateway and batch store all run for real.
`tokenfleet serve --runner fixed` selects it; never use it to serve callers.
"""

from __future__ import annotations

from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.models.config import ModelConfig

FIXED_NUM_BLOCKS = 4096


class FixedTokenRunner:
    def __init__(self, config: ModelConfig, token_id: int, num_blocks: int) -> None:
        if not 0 <= token_id < config.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        self.config = config
        self.token_id = token_id
        self.num_blocks = num_blocks

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput({s.req_id: self.token_id for s in so.scheduled if s.sample})
