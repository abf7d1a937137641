"""The gateway's settings, frozen and validated; flags and env vars are read in cli.py."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from tokenfleet.config import EngineConfig

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class BatchConfig:
    """The Batch API: where its store lives and its limits and clocks."""

    data_dir: Path = Path("~/.local/share/tokenfleet")
    database_url: str | None = None  # None: SQLite in data_dir
    gateway_id: str = "gateway"  # lease owner: distinct for each gateway sharing one store
    max_batch_requests: int = 100_000
    max_batch_bytes: int = 256 * 2**20
    batch_expiry_s: float = 24 * 3600.0
    retention_s: float = 29 * 24 * 3600.0
    lease_s: float = 120.0
    max_attempts: int = 3

    def __post_init__(self) -> None:
        if self.max_batch_requests < 1 or self.max_batch_bytes < 1024:
            raise ValueError("batch limits must be positive (and at least 1 KiB of body)")
        if min(self.batch_expiry_s, self.lease_s, self.retention_s) <= 0:
            raise ValueError("batch expiry, retention and lease times must be positive")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'batches.db'}"


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "smollm2-135m-instruct"
    api_keys: frozenset[str] = frozenset()
    max_body_bytes: int = 8 * 2**20
    # Admission control: refuse an interactive request whose predicted time to first
    # token exceeds this (seconds), instead of queueing it without bound.
    ttft_target_s: float = 2.0
    # Prefill speed assumed until the gateway has measured the engine's own.
    initial_prefill_tokens_per_s: float = 1000.0
    heartbeat_timeout_s: float = 30.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)

    def __post_init__(self) -> None:
        if not self.api_keys and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without API keys: pass --api-key or "
                "--api-keys-file, or bind to 127.0.0.1"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.ttft_target_s <= 0:
            raise ValueError(f"ttft_target_s must be positive, got {self.ttft_target_s}")
