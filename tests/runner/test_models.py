"""Every supported architecture and RoPE variant against transformers, on tiny random
models written with save_pretrained: greedy ids equal, logprobs equal within 1e-4."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.reference import assert_matches_transformers

from tokenfleet import LLM, SamplingParams
from tokenfleet.config import EngineConfig
from tokenfleet.errors import ModelLoadError

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], list(range(20, 57)), [7] * 3]
NEW_TOKENS = 12

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-untied": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama-tied-mha": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            },
        },
    ),
    "llama-linear-rope-bias": (
        "LlamaConfig",
        {
            "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "attention_bias": True,
        },
    ),
    "qwen2-yarn": (
        "Qwen2Config",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
            "tie_word_embeddings": True,
        },
    ),
    "mistral-sliding-window": ("MistralConfig", {"sliding_window": 8, "head_dim": 24}),
}


def _make(tmp_path: Path, name: str) -> tuple[Path, torch.nn.Module]:
    import transformers

    config_cls, overrides = CASES[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path / name
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tiny_model_matches_transformers(tmp_path: Path, name: str, backend: str) -> None:
    folder, hf = _make(tmp_path, name)
    llm = LLM(
        str(folder),
        block_size=4,
        max_num_batched_tokens=16,
        kv_cache_memory=4 << 20,
        attention_backend=backend,
    )
    assert llm.engine.runner.use_kernel == (backend == "auto")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert_matches_transformers(hf, prompt, out, num_top=3)


def test_bfloat16_runs_close_to_transformers_bfloat16(tmp_path: Path) -> None:
    folder, hf = _make(tmp_path, "llama-untied")
    llm = LLM(str(folder), dtype="bfloat16", block_size=4, kv_cache_memory=4 << 20)
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
    with torch.inference_mode():
        logits = hf.to(torch.bfloat16)(torch.tensor([PROMPTS[1]])).logits[0, -1].float()
    assert out.token_ids == [int(logits.argmax())]
    assert out.logprobs is not None
    assert out.logprobs[0].logprob == pytest.approx(logits.log_softmax(-1).max().item(), abs=0.05)


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model folder .*nowhere does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    folder, _ = _make(tmp_path, "llama-untied")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(folder))


def test_unsupported_rope_type_is_named(tmp_path: Path) -> None:
    folder, _ = _make(tmp_path, "llama-untied")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="longrope"):
        LLM(str(folder))


def test_folder_without_weights_is_a_clear_error(tmp_path: Path) -> None:
    folder, _ = _make(tmp_path, "llama-untied")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        LLM(str(folder))


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("way", ["blocks", "transposed", "onednn"])
def test_vocab_logits_equal_the_whole_product(rows: int, way: str) -> None:
    """The CPU float32 logits, in blocks of the vocabulary, through oneDNN's packed copy, or
    for one row through the transposed copy (each where tune_products keeps it), are the one
    product's, to float rounding: a vocabulary that is not a multiple of the block, and the
    tied embedding weight."""
    from tokenfleet.models import packed
    from tokenfleet.models.config import ModelConfig
    from tokenfleet.models.llama import VOCAB_BLOCK, LlamaForCausalLM

    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 2 * VOCAB_BLOCK + 77,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # blocks until tune_products or set here
    if way == "transposed":
        model._weight_t = model.lm_head.weight.detach().t().contiguous()
    elif way == "onednn":
        model._vocab_packed = packed.pack(model.lm_head.weight)
    h = torch.randn(rows, 64)
    with torch.inference_mode():
        whole = torch.nn.functional.linear(h, model.embed_tokens.weight)
        got = model.vocab_logits(h)
    assert got.shape == (rows, 2 * VOCAB_BLOCK + 77)
    torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-5)
    assert torch.equal(got.argmax(dim=1), whole.argmax(dim=1))


@pytest.mark.parametrize("backend", ["torch", "onednn"])
def test_linear_backend_is_chosen_and_matches_transformers(tmp_path: Path, backend: str) -> None:
    """linear_backend "onednn" runs every decoder product and the vocabulary through
    oneDNN's packed weights (no nn.Linear left in the layers), "torch" through torch's BLAS;
    both give transformers' greedy tokens and logprobs. "auto" picks one of them by timing."""
    from tokenfleet.models.packed import PackedLinear

    folder, hf = _make(tmp_path, "llama-linear-rope-bias")  # biases: the packed op adds them
    llm = LLM(str(folder), block_size=4, kv_cache_memory=4 << 20, linear_backend=backend)
    model = llm.engine.runner.model
    assert model.linear_backend == backend
    layers = list(model.layers.modules())
    assert any(isinstance(m, PackedLinear) for m in layers) == (backend == "onednn")
    assert any(isinstance(m, torch.nn.Linear) for m in layers) == (backend == "torch")
    assert (model._vocab_packed is not None) == (backend == "onednn")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        assert_matches_transformers(hf, prompt, out, num_top=3)
    auto = LLM(str(folder), block_size=4, kv_cache_memory=4 << 20)
    assert auto.engine.runner.model.linear_backend in ("torch", "onednn")


def test_linear_backend_is_checked() -> None:
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        EngineConfig(linear_backend="mkl")
    with pytest.raises(ValueError, match="float32 on the CPU only"):
        EngineConfig(linear_backend="onednn", dtype="bfloat16")
