"""FixedTokenRunner: answers every step without running a model, for plumbing tests at a
scale the real model cannot reach in CI (a 100,000-request batch, say).

Every sampled token is the same fixed token id, so outputs are known in advance; the
scheduler, KV manager, engine process, gateway and batch store all run for real. A step
can be made to take time, as a forward pass would, without holding the GIL (a sleep):
`step_s` for every step with work, plus `prefill_s_per_token` for each token beyond a
request's one decode token (a prompt's, or a chunk's), so that prefix-cache hits save
time as they would on an accelerator (the router benchmark, bench/fleet_router.py).
`tokenfleet serve --runner fixed` selects it; never use it to serve callers.

`extra_step_s_for_tests` slows every fixed runner of the process (a replica made slow on
purpose, cluster/replica.py's ReplicaActor.set_extra_step_s_for_tests): a test's knob, read
each step, 0 unless a test sets it.
"""

from __future__ import annotations

import time
from typing import ClassVar

from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.models.config import ModelConfig

FIXED_NUM_BLOCKS = 4096


class FixedTokenRunner:
    extra_step_s_for_tests: ClassVar[float] = 0.0

    def __init__(
        self,
        config: ModelConfig,
        token_id: int,
        num_blocks: int,
        *,
        step_s: float = 0.0,
        prefill_s_per_token: float = 0.0,
    ) -> None:
        if not 0 <= token_id < config.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        self.config = config
        self.token_id = token_id
        self.num_blocks = num_blocks
        self.step_s = step_s
        self.prefill_s_per_token = prefill_s_per_token

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.run(self.prepare(so))

    def prepare(self, so: SchedulerOutput) -> SchedulerOutput:
        """Nothing to put on a device: the step is its own input."""
        return so

    @staticmethod
    def fill_placeholders(so: SchedulerOutput, sampled: object) -> None:
        """Nothing to fill: the fixed token does not depend on the inputs."""

    def run(self, so: SchedulerOutput, masks: object = None) -> ModelRunnerOutput:
        """The step held as set; `masks` never come (no constraint reaches this runner)."""
        extra = FixedTokenRunner.extra_step_s_for_tests
        if so.scheduled and (self.step_s or self.prefill_s_per_token or extra):
            prefill = sum(max(0, s.num_tokens - 1) for s in so.scheduled)
            time.sleep(self.step_s + self.prefill_s_per_token * prefill + extra)
        return ModelRunnerOutput({s.req_id: self.token_id for s in so.scheduled if s.sample})
