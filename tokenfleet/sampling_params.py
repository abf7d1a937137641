"""Per-request sampling settings, validated once at construction.

A msgspec Struct so that it crosses the process boundary as it is.
"""

from __future__ import annotations

import msgspec

from tokenfleet.errors import InvalidRequestError

MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to pick each next token, and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 mean off. `logprobs` None
    returns none; 0 returns the chosen token's logprob; k > 0 adds the top k.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens"
            )
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", param="temperature"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (off) or positive, got {self.top_k}", param="top_k"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
                param="logprobs",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
