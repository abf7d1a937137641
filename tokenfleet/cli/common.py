"""Helpers that every subcommand's parser shares: the environment epilog, path flags."""

from __future__ import annotations

from pathlib import Path

from tokenfleet import envs


def env_help() -> str:
    lines = ["environment variables:"]
    for name, (default, meaning) in envs.ENVIRONMENT_VARIABLES.items():
        lines.append(f"  {name:<24} {meaning} (default: {default or 'unset'})")
    return "\n".join(lines)


def path(value: str) -> Path:
    return Path(value).expanduser()
