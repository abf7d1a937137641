"""Typed errors. The HTTP edge maps each to a status code and its API's error body."""

from __future__ import annotations


class TokenfleetError(Exception):
    """Base of every error tokenfleet raises on purpose."""


class InvalidRequestError(TokenfleetError, ValueError):
    """A caller's input is wrong; `param` names the offending field (maps to HTTP 400)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt plus max_tokens does not fit the model's context (maps to HTTP 400)."""


class ModelLoadError(TokenfleetError):
    """A model folder is missing, incomplete, or of an architecture we do not serve."""
