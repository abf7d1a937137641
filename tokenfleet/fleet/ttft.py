"""A replica's time to first token for a new interactive prompt, judged from the state the
replica itself reports (SchedulerStats), so that every gateway judges it alike.

The same replay as single-replica admission (policy/replay.py's predict_ttft, the engine's
own planning priced by its own step-time model): the replica's running decodes by class,
the interactive prompts it has not finished computing (plus those this gateway sent since
its last report), then the new prompt. The fleet's router keeps affinity off a replica
whose prediction misses the target while another meets it, and the gateway refuses a
prompt (529 / 429) only when no replica meets it.

Torch-free; the simulator can run it on its replicas' stats too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import SchedulerStats
from tokenfleet.policy.harvest import step_time_limit
from tokenfleet.policy.replay import Decodes, StepLimit, predict_ttft


@dataclass(frozen=True)
class ReplicaTTFT:
    """The replicas' engine settings the replay needs (one config for the fleet)."""

    ttft_target_s: float
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    long_prefill_cap: int
    limit: StepLimit | None

    @classmethod
    def of(cls, engine: EngineConfig, ttft_target_s: float) -> ReplicaTTFT:
        scheduler = engine.scheduler.under(engine.scheduling_policy)
        limit = None
        if engine.scheduling_policy == "priority":
            seconds = step_time_limit(engine.tpot_target_s, engine.harvest_margin)
            limit = StepLimit(seconds, engine.min_prefill_chunk, engine.tpot_target_s)
        return cls(
            ttft_target_s,
            scheduler.max_num_batched_tokens,
            scheduler.max_num_seqs,
            engine.cache.block_size,
            scheduler.long_prefill_token_threshold,
            limit,
        )

    def predict(
        self, stats: SchedulerStats | None, num_prompt_tokens: int, sent: Sequence[int] = ()
    ) -> float:
        """Seconds to the first token of a prompt of `num_prompt_tokens` (uncached) on a
        replica in the state `stats`, with the prompts of `sent` (this gateway's, since
        that report) ahead too. Over the target it is a lower bound; with no step-time
        model yet (a replica just started) 0: nothing known against it."""
        if stats is None or not any(v > 0 for v in stats.step_time_coefficients.values()):
            return 0.0
        decoding = stats.num_decoding_by_class
        kv = stats.decode_kv_tokens_by_class
        interactive = Decodes(decoding.get("interactive", 0), kv.get("interactive", 0))
        batch = Decodes(decoding.get("batch", 0), kv.get("batch", 0))
        return predict_ttft(
            stats.step_time_coefficients,
            self.max_num_batched_tokens,
            num_prompt_tokens,
            [*stats.interactive_prefill_left, *sent],
            interactive,
            batch,
            self.limit,
            None,
            stats.step_time_profile or None,
            self.long_prefill_cap,
            stop_over=self.ttft_target_s,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
        )

    def meets(self, seconds: float) -> bool:
        return math.isfinite(seconds) and seconds <= self.ttft_target_s
