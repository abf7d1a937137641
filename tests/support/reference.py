"""Comparisons against Hugging Face transformers, shared by the model and sampling tests."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.llm import RequestOutput


def assert_matches_transformers(
    hf: torch.nn.Module, prompt: list[int], out: RequestOutput, num_top: int
) -> None:
    """Greedy ids are transformers' argmax at every step; logprobs and the top-k agree."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    reference = logits.float().log_softmax(-1)
    assert out.token_ids == reference.argmax(-1).tolist()
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step]
        assert lp.logprob == pytest.approx(reference[step, lp.token_id].item(), abs=1e-4)
        values, ids = reference[step].topk(num_top)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
