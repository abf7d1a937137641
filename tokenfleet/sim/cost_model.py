"""The simulator's cost model: seconds for one engine step, in place of the model runner.

Two kinds, both priced from the step's StepFeatures (step_model.py), so a step costs what
its SchedulerOutput says it does:

* RooflineCost: from a Deployment's datasheet numbers. A step reads the weights once and
  every request's context KV, and does 2 FLOPs per weight per token plus attention; it
  takes the longer of the two (memory- or compute-bound), plus the tensor-parallel
  all-reduces (two a layer, ring) and a fixed per-step overhead.
* LinearStepCost (step_model.py): the engine's own step-time model, t = coefficients .
  TERMS, with the coefficients a measured engine fitted (StepTimeModel.coefficients,
  /metrics, JSON).

The replica's *scheduler* never sees the cost model: like the engine, it plans with a
StepTimeModel fitted on a start-up profile (profile_step_model), here priced by the cost
model instead of timed on a runner. A roofline is not linear, so that fit is off where
steps turn from memory- to compute-bound, as a real engine's is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfleet.policy.step_model import (
    LinearStepCost,
    StepCost,
    StepFeatures,
    StepModelConfig,
    StepSample,
    StepTimeModel,
)
from tokenfleet.sim.hardware import Deployment


@dataclass(frozen=True)
class RooflineCost:
    deployment: Deployment

    def predict(self, features: StepFeatures) -> float:
        acc = self.deployment.accelerator
        model = self.deployment.model
        tp = self.deployment.tensor_parallel
        num_tokens = features.prefill_tokens + features.decode_seqs
        # A decode attends to its whole context; a prefill chunk's pairs are its
        # prefill_attention (its context read once more is noise beside them).
        pairs = features.prefill_attention + features.kv_tokens_read
        flops = 2 * model.matmul_params * num_tokens + model.attention_flops_per_pair * pairs
        compute_s = flops / (tp * acc.bf16_flops * acc.compute_efficiency)
        read = model.weight_bytes + features.kv_tokens_read * model.kv_bytes_per_token
        memory_s = read / (tp * acc.hbm_bytes_per_s * acc.memory_efficiency)
        return acc.step_overhead_s + max(compute_s, memory_s) + self.all_reduce_s(num_tokens)

    def all_reduce_s(self, num_tokens: int) -> float:
        """Two ring all-reduces a layer of the step's hidden states (0 without TP)."""
        tp = self.deployment.tensor_parallel
        if tp == 1:
            return 0.0
        acc = self.deployment.accelerator
        model = self.deployment.model
        payload = num_tokens * model.hidden_size * model.bytes_per_param
        one = acc.all_reduce_latency_s + 2 * (tp - 1) / tp * payload / (
            acc.link_bytes_per_s * acc.link_efficiency
        )
        return 2 * model.num_layers * one


def load_coefficients(path: Path) -> LinearStepCost:
    """Coefficients from JSON: {term: seconds} as StepTimeModel.coefficients gives them,
    or that under a "coefficients" key."""
    data: Any = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("coefficients"), dict):
        data = data["coefficients"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of coefficients")
    return LinearStepCost.from_dict({str(k): float(v) for k, v in data.items()})


def profile_features(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[StepFeatures]:
    """The steps of a start-up profile: decode batches at several contexts, prefill chunks
    at several starts, and the two mixed (the shapes the engine's profile times)."""
    contexts = [c for c in (64, 512, 2048, 8192, 16384) if c < max_model_len] or [1]
    seqs = sorted({1, 4, 16, 64, 256, max_num_seqs} & set(range(1, max_num_seqs + 1)))
    chunks = sorted({16, 64, 256, 1024, 4096, max_num_batched_tokens})
    chunks = [c for c in chunks if c <= max_num_batched_tokens]
    steps = []
    for context in contexts:
        decode = [StepFeatures.of_chunk(1, context - 1)]
        for n in seqs:
            steps.append(_times(decode[0], n))
        for chunk in chunks:
            if chunk + context <= max_model_len:
                prefill = StepFeatures.of_chunk(chunk, context)
                steps.append(prefill)
                steps.append(prefill + _times(decode[0], max(1, max_num_seqs // 2)))
    return steps


def _times(features: StepFeatures, n: int) -> StepFeatures:
    return StepFeatures(
        features.prefill_tokens * n,
        features.decode_seqs * n,
        features.kv_tokens_read * n,
        features.prefill_attention * n,
    )


def profile_step_model(
    cost: StepCost, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> StepTimeModel:
    """The engine's StepTimeModel, fitted on a profile priced by `cost` (the simulated
    counterpart of the engine's start-up profile)."""
    samples = [
        StepSample(f, cost.predict(f))
        for f in profile_features(max_num_batched_tokens, max_num_seqs, max_model_len)
    ]
    model = StepTimeModel(StepModelConfig(profile=False))
    model.fit(samples)
    return model
