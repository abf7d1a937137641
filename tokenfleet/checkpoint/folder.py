"""Where a model's Hugging Face folder is: torch-free, so the gateway can ask too."""

from __future__ import annotations

from pathlib import Path

from tokenfleet import envs
from tokenfleet.errors import ModelLoadError


def resolve_model_folder(model: str | None) -> Path:
    """A Hugging Face folder; None means the bundled model, converted on first use."""
    if model is None:
        from tokenfleet.checkpoint.bundled import prepare_bundled_model

        return prepare_bundled_model(envs.cache_dir() / "models")
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    return folder
