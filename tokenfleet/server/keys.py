"""API keys and their groups: reading them at start-up (refusing blank or unprintable
keys), and finding a request's key among them from any header bytes.

A group is the unit of rate limits, of batch quotas and of prefix-cache sharing:
`--api-keys-file` lines are `KEY GROUP` (a key alone is its own group). What a key
creates (batches, files) is its own: it is owned by a digest of the key, and only the key
sees it. The operator key opens /metrics and the
admin routes only, and may not be a caller's key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from pathlib import Path

from starlette.types import Scope

# The group of the request being served (set by the gateway; None without keys), read by
# the service for its limits and its prefix-cache salt.
CALLER_GROUP: ContextVar[str | None] = ContextVar("tokenfleet_caller_group", default=None)

# The group of every request when no keys are set: limits still apply, to everyone at once.
ANONYMOUS_GROUP = "anonymous"


def owner_id(key: str | None) -> str:
    """Who owns what a key creates: a digest of the key ("" without keys)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


class Owners:
    """The key groups seen from the batch store, which knows owners (key digests) only:
    an owner's group (its batch requests' prefix-cache salt) and the owners of its group
    (whose batches and files count against one quota)."""

    def __init__(self, key_groups: Iterable[tuple[str, str]]) -> None:
        self._group = {owner_id(key): group for key, group in key_groups}
        self._members: dict[str, list[str]] = {}
        for owner, group in self._group.items():
            self._members.setdefault(group, []).append(owner)

    def group(self, owner: str) -> str | None:
        """The owner's key group; None without keys (as CALLER_GROUP)."""
        return self._group.get(owner)

    def members(self, owner: str) -> tuple[str, ...]:
        """The owners whose work counts against this owner's quotas, itself included."""
        group = self._group.get(owner)
        return (owner,) if group is None else tuple(self._members[group])


class KeyRefused(ValueError):
    """A key or keys file refused at start-up (the message says which and why)."""


def check_key(key: str, where: str) -> str:
    """A key as given, or KeyRefused: empty, whitespace, or not printable ASCII (a header
    value a client could not send)."""
    if not key.strip():
        raise KeyRefused(f"{where}: an API key may not be empty or whitespace")
    if key != key.strip() or not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise KeyRefused(
            f"{where}: an API key must be printable ASCII without spaces or control characters"
        )
    return key


def own_group(key: str) -> str:
    """The group of a key given alone: its own, named by a digest (never the key itself,
    which would then appear in metrics and logs)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def read_keys_file(path: Path) -> dict[str, str]:
    """key -> group from a keys file: `KEY` or `KEY GROUP` a line, `#` comments; a blank
    line, a line of three fields or a key given twice is refused."""
    keys: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        where = f"{path}:{number}"
        if line.lstrip().startswith("#"):
            continue
        fields = line.split()
        if not fields:
            raise KeyRefused(f"{where}: blank line (an empty API key is not accepted)")
        if len(fields) > 2:
            raise KeyRefused(f"{where}: expected `KEY` or `KEY GROUP`, got {len(fields)} fields")
        key = check_key(fields[0], where)
        if key in keys:
            raise KeyRefused(f"{where}: this key is already listed")
        keys[key] = fields[1] if len(fields) == 2 else own_group(key)
    return keys


def gather_keys(
    given: Iterable[str], keys_file: Path | None, operator_key: str | None
) -> tuple[dict[str, str], str | None]:
    """Every caller key -> its group, and the operator key; KeyRefused for a bad one."""
    keys: dict[str, str] = {}
    for key in given:
        keys[check_key(key, "--api-key")] = own_group(key)
    if keys_file is not None:
        for key, group in read_keys_file(keys_file).items():
            keys.setdefault(key, group)
    if operator_key is not None:
        check_key(operator_key, "--operator-key")
        if operator_key in keys:
            raise KeyRefused("--operator-key must differ from every caller's API key")
    return keys, operator_key


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def presented_key(scope: Scope) -> bytes | None:
    """The key the request presents, as raw bytes: x-api-key, else a Bearer token."""
    given = _header(scope, b"x-api-key")
    if given is None:
        auth = _header(scope, b"authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
    return given


class KeyRing:
    """The configured keys, matched in constant time per key against header bytes (which
    may hold anything: compared as bytes, never decoded)."""

    def __init__(self, groups: Mapping[str, str], operator_key: str | None) -> None:
        self._keys = [(k.encode(), k, g) for k, g in groups.items()]
        self._operator = operator_key.encode() if operator_key is not None else None

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def caller(self, scope: Scope) -> tuple[str, str] | None:
        """(key, group) of the caller's key, or None."""
        given = presented_key(scope)
        if given is None:
            return None
        found = None
        for raw, key, group in self._keys:
            if hmac.compare_digest(given, raw):
                found = (key, group)
        return found

    def is_operator(self, scope: Scope) -> bool:
        given = presented_key(scope)
        return (
            given is not None
            and self._operator is not None
            and hmac.compare_digest(given, self._operator)
        )
