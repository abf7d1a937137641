"""Every environment variable tokenfleet reads, declared and read in this one place."""

from __future__ import annotations

import os
from pathlib import Path

# name -> (default, meaning); `tokenfleet --help` and the README list these.
ENVIRONMENT_VARIABLES: dict[str, tuple[str, str]] = {
    "TOKENFLEET_CACHE_DIR": (
        "~/.cache/tokenfleet",
        "where the bundled model is converted to a Hugging Face folder",
    ),
    "TOKENFLEET_NUM_THREADS": (
        "",
        "torch intra-op threads for the model runner (default: torch's)",
    ),
    "TOKENFLEET_HOST": ("127.0.0.1", "address `tokenfleet serve` listens on"),
    "TOKENFLEET_PORT": ("8000", "port `tokenfleet serve` listens on"),
    "TOKENFLEET_API_KEY": ("", "an API key callers must send (x-api-key or Bearer)"),
    "TOKENFLEET_URL": ("http://127.0.0.1:8000", "the server `tokenfleet batch` calls"),
    "TOKENFLEET_API_KEYS_FILE": (
        "",
        "a file of API keys, one a line: `KEY` or `KEY GROUP` (a key alone is its own group)",
    ),
    "TOKENFLEET_OPERATOR_KEY": (
        "",
        "the key that opens /metrics and admin routes (x-api-key or Bearer); not a caller's",
    ),
    "TOKENFLEET_MODEL": ("", "a Hugging Face model folder (default: the bundled model)"),
    "TOKENFLEET_DATA_DIR": (
        "~/.local/share/tokenfleet",
        "the batch store (SQLite) and uploaded files",
    ),
    "TOKENFLEET_REPLICAS": (
        "",
        "engine replicas on Ray (`serve --replicas`); unset: one local engine process, no Ray",
    ),
    "TOKENFLEET_RAY_ADDRESS": (
        "",
        "a Ray cluster to place replicas on (`serve --ray-address`, from `ray start --head`)",
    ),
    "TOKENFLEET_DATABASE_URL": (
        "",
        "the batch store: postgresql://... to share one among gateways (default: SQLite "
        "in the data folder)",
    ),
}


def _get(name: str) -> str:
    return os.environ.get(name, ENVIRONMENT_VARIABLES[name][0])


def cache_dir() -> Path:
    return Path(_get("TOKENFLEET_CACHE_DIR")).expanduser()


def data_dir() -> Path:
    return Path(_get("TOKENFLEET_DATA_DIR")).expanduser()


def num_threads() -> int | None:
    value = _get("TOKENFLEET_NUM_THREADS")
    return int(value) if value else None


def get(name: str) -> str:
    """The variable's value, or its declared default."""
    return _get(name)
