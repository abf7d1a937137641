"""Shared fixtures: the bundled model folder, converted once per machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_folder() -> Path:
    from tokenfleet import envs
    from tokenfleet.bundled_model import prepare_bundled_model

    return prepare_bundled_model(envs.cache_dir() / "models", progress=False)
