"""The gateway's settings, frozen and validated; flags and env vars are read in cli.py."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

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
