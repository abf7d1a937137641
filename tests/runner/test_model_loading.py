"""How the runner gets its weights and its KV cache: the model is built on the meta
device and filled one checkpoint tensor at a time; the cache is sized from free memory."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import tokenfleet.models.loader as loader
import tokenfleet.runner.model_runner
from tokenfleet import LLM


@pytest.mark.fake("free memory probe")
def test_kv_blocks_come_from_a_fraction_of_free_memory_as_a_fake_probe_reports_it(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The machine's free memory is whatever it is: a stand-in probe reports 1 GB.
    monkeypatch.setattr(tokenfleet.runner.model_runner, "free_device_memory", lambda device: 10**9)
    llm = LLM(str(model_folder), kv_cache_memory_fraction=0.05)
    bytes_per_block = 2 * 30 * 3 * 64 * 4 * 16  # K and V, 30 layers, 3 KV heads, fp32
    assert llm.engine.runner.num_blocks == 5 * 10**7 // bytes_per_block == 67
    assert llm.engine.kv.pool.num_blocks == 67


def test_model_is_built_on_meta_and_filled_one_tensor_at_a_time(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built_on: list[set[str]] = []
    real_model = loader.LlamaForCausalLM

    class Recording(real_model):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built_on.append({p.device.type for p in self.parameters()})

    alive_at_read: list[int] = []
    read: list[weakref.ref[torch.Tensor]] = []
    real_open = loader.safe_open

    class CountingOpen:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._inner = real_open(*args, **kwargs)

        def __enter__(self) -> CountingOpen:
            self._file = self._inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self._file.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            alive_at_read.append(sum(r() is not None for r in read))
            tensor = self._file.get_tensor(name)
            read.append(weakref.ref(tensor))
            return tensor

    monkeypatch.setattr(loader, "LlamaForCausalLM", Recording)
    monkeypatch.setattr(loader, "safe_open", CountingOpen)
    model = loader.load_model(model_folder, torch.device("cpu"), torch.float32)
    assert built_on == [{"meta"}]
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert len(alive_at_read) == 272  # every tensor of the checkpoint was read...
    assert max(alive_at_read) == 0  # ...and each was gone before the next one was read
