"""The in-process fleets' settings (support/local_fleet.py), shared by the modules that
build them: the fixed runner at local_fleet's step time, and the token it samples."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.local_fleet import STEP_S

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.config import EngineConfig


@pytest.fixture(scope="module")
def config(model_folder: Path) -> EngineConfig:
    return EngineConfig(model=str(model_folder), runner="fixed", fixed_step_s=STEP_S)


@pytest.fixture(scope="module")
def fixed_token(model_folder: Path) -> int:
    """The token the fixed runner samples (" a", as engine/core.py picks it)."""
    return Tokenizer(model_folder).encode(" a")[-1]
