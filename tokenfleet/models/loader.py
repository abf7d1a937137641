"""Builds a model on the meta device and fills it from a folder's safetensors files.

Parameters are allocated once (to_empty) and each checkpoint tensor is read from the
memory-mapped file and copied into its place (or its slice of a fused q/k/v or gate/up
parameter) one at a time, so the weights never exist twice in memory.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from tokenfleet.errors import ModelLoadError
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_FUSED = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)")


def _target(model: LlamaForCausalLM, name: str) -> tuple[torch.Tensor, int, int] | None:
    """The parameter a checkpoint tensor fills, and the row range it fills in it."""
    cfg = model.config
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None  # tied: the embedding fills it
    match = _FUSED.fullmatch(name)
    if match:
        layer_idx, _, part, kind = match.groups()
        layer = model.layers[int(layer_idx)]
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused, start, size = {
            "q": (layer.self_attn.qkv_proj, 0, q),
            "k": (layer.self_attn.qkv_proj, q, kv),
            "v": (layer.self_attn.qkv_proj, q + kv, kv),
            "gate": (layer.mlp.gate_up_proj, 0, inter),
            "up": (layer.mlp.gate_up_proj, inter, inter),
        }[part]
        return getattr(fused, kind), start, size
    own = name.removeprefix("model.")
    params = dict(model.named_parameters())
    if own not in params:
        return None
    param = params[own]
    return param, 0, param.shape[0]


def load_model(
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    use_kernel: bool = True,
    linear_backend: str = "auto",
) -> LlamaForCausalLM:
    config = ModelConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {folder} has no *.safetensors files")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, use_kernel)
    model.to_empty(device=device)
    model.to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    expected = {id(p): name for name, p in model.named_parameters()}
    filled: dict[int, int] = {}
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    target = _target(model, name)
                    if target is None:
                        logger.debug("skipping checkpoint tensor %s", name)
                        continue
                    param, start, size = target
                    tensor = f.get_tensor(name)
                    if tensor.shape[0] != size or tensor.shape[1:] != param.shape[1:]:
                        raise ModelLoadError(
                            f"{file.name}: {name} has shape {list(tensor.shape)}, "
                            f"the config implies {[size, *param.shape[1:]]}"
                        )
                    param[start : start + size].copy_(tensor)
                    del tensor  # one checkpoint tensor in memory at a time
                    filled[id(param)] = filled.get(id(param), 0) + size
    rows = {id(p): p.shape[0] for p in model.parameters()}
    missing = [name for pid, name in expected.items() if filled.get(pid, 0) != rows[pid]]
    if missing:
        raise ModelLoadError(f"model folder {folder} lacks weights for {missing[:5]}")
    model.eval()
    model.tune_products(linear_backend)
    logger.info("linear layers: %s", model.linear_backend)
    model.use_fused(use_kernel)
    return model
