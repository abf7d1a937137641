"""The gateway's settings, frozen and validated; flags and env vars are read in cli.py."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from tokenfleet.batch.database import engine_url
from tokenfleet.config import EngineConfig, FleetConfig
from tokenfleet.server.connections import ReadDeadlines
from tokenfleet.server.limits import GroupLimits

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
    max_attempts: int = 3  # failures of a request itself (its engine died running it)
    # Quotas per key group (a key given alone is its own group): requests of its batches
    # waiting to run (queued or leased), and bytes of its stored files.
    max_queued_per_key: int = 1_000_000
    max_file_bytes_per_key: int = 16 * 2**30

    def __post_init__(self) -> None:
        if self.max_batch_requests < 1 or self.max_batch_bytes < 1024:
            raise ValueError("batch limits must be positive (and at least 1 KiB of body)")
        if min(self.batch_expiry_s, self.lease_s, self.retention_s) <= 0:
            raise ValueError("batch expiry, retention and lease times must be positive")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.max_queued_per_key < 1 or self.max_file_bytes_per_key < 1:
            raise ValueError("the queued-request and stored-file quotas must be positive")

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
    # Each caller key's group (the unit of rate limits and prefix-cache sharing); a key
    # missing here is its own group. The operator key opens /metrics and admin routes.
    key_groups: tuple[tuple[str, str], ...] = ()
    operator_key: str | None = None
    limits: GroupLimits = field(default_factory=GroupLimits)
    # Whether `limits` are kept in the batch store, one allowance per group for every
    # gateway sharing it, rather than in this gateway's memory; None: when the store is
    # PostgreSQL (SQLite is one gateway's). See limits_shared.
    shared_limits: bool | None = None
    read_deadlines: ReadDeadlines = field(default_factory=ReadDeadlines)
    # Connections open at once (uvicorn's limit_concurrency: a 503 beyond) and seconds an
    # idle kept-alive connection is held.
    max_connections: int = 1024
    keep_alive_s: float = 5.0
    # A stream whose reader falls behind: once the server's send buffer is full, it is
    # aborted (its engine request and KV blocks freed) after this many seconds.
    stream_stall_timeout_s: float = 30.0
    # Generation bodies over this many bytes are checked and tokenized off the event loop,
    # in a pool of `check_threads` threads.
    offload_body_bytes: int = 16 * 1024
    check_threads: int = 2
    max_body_bytes: int = 8 * 2**20
    # Engine requests one API request or batch line may become (prompts x n).
    max_engine_requests_per_request: int = 64
    # The URL clients reach this server at, for the URLs it hands out (batch results);
    # None: from X-Forwarded-Proto/-Host/-Prefix, else the request's own.
    public_base_url: str | None = None
    # Admission control: refuse an interactive request whose predicted time to first
    # token exceeds this (seconds), instead of queueing it without bound.
    ttft_target_s: float = 2.0
    # Prefill speed assumed until the gateway has measured the engine's own.
    initial_prefill_tokens_per_s: float = 1000.0
    heartbeat_timeout_s: float = 30.0
    # The engine process: killed if it has not said it is ready this long after it started
    # (a hung start); restarted after a death with exponential backoff from
    # engine_restart_backoff_s, at most engine_restart_backoff_max_s between tries.
    engine_start_timeout_s: float = 600.0
    engine_restart_backoff_s: float = 0.5
    engine_restart_backoff_max_s: float = 60.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    # Replicas on Ray (--replicas, --ray-address); None: one local engine process.
    fleet: FleetConfig | None = None

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
        if self.max_engine_requests_per_request < 1:
            raise ValueError("max_engine_requests_per_request must be at least 1")
        if self.public_base_url is not None and not re.fullmatch(
            r"https?://[^/?#\s]+(/[^?#\s]*)?", self.public_base_url
        ):
            raise ValueError(
                f"public_base_url must be an http(s) URL, got {self.public_base_url!r}"
            )
        if self.operator_key is not None and self.operator_key in self.api_keys:
            raise ValueError("--operator-key must differ from every caller's API key")
        if self.max_connections < 1 or self.keep_alive_s <= 0:
            raise ValueError("max_connections and keep_alive_s must be positive")
        if self.stream_stall_timeout_s <= 0 or self.check_threads < 1:
            raise ValueError("stream_stall_timeout_s and check_threads must be positive")
        deadlines = self.read_deadlines
        if min(deadlines.header_timeout_s, deadlines.body_timeout_s) <= 0:
            raise ValueError("header and body read timeouts must be positive")
        if deadlines.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be at least 1024")
        if self.ttft_target_s <= 0:
            raise ValueError(f"ttft_target_s must be positive, got {self.ttft_target_s}")
        if self.engine_start_timeout_s <= 0 or self.engine_restart_backoff_s < 0:
            raise ValueError("engine start timeout must be positive, restart backoff >= 0")
        if self.engine_restart_backoff_max_s < self.engine_restart_backoff_s:
            raise ValueError("engine restart backoff cap must be at least the initial backoff")

    @property
    def limits_shared(self) -> bool:
        """`shared_limits`, None resolved by the batch store's dialect."""
        if self.shared_limits is not None:
            return self.shared_limits
        return engine_url(self.batch.url).get_backend_name() == "postgresql"
