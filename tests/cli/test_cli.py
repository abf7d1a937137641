"""`tokenfleet serve`'s settings: flags and environment variables, read in one place
(cli/serve.py with envs.py), and documented by `tokenfleet serve --help`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenfleet import envs
from tokenfleet.cli.main import build_parser


def _serve_help(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}
    result = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", "serve", "--help"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout


def test_serve_help_documents_the_flags_and_every_environment_variable() -> None:
    text = _serve_help({"TOKENFLEET_PORT": "8765", "TOKENFLEET_HOST": "127.0.0.3"})
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = [s for a in serve._actions for s in a.option_strings if s.startswith("--")]
    assert {"--tpot-target", "--ttft-target", "--api-key", "--api-keys-file"} <= set(flags)
    for flag in flags:
        assert flag in text, flag
    words = " ".join(text.split())  # argparse wraps lines
    for name, (_, meaning) in envs.ENVIRONMENT_VARIABLES.items():
        assert f"{name} {' '.join(meaning.split())}" in words, name
    # The defaults shown are the environment's, as the server would take them.
    assert "(default 8765)" in text and "(default 127.0.0.3)" in text


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLEET_PORT", "8765")
    monkeypatch.setenv("TOKENFLEET_API_KEY", "from-env")
    monkeypatch.setenv("TOKENFLEET_NUM_THREADS", "3")
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.api_key, args.num_threads) == (8765, ["from-env"], 3)
    args = build_parser().parse_args(["serve", "--port", "9001", "--num-threads", "1"])
    assert (args.port, args.num_threads) == (9001, 1)
    monkeypatch.delenv("TOKENFLEET_PORT")
    assert build_parser().parse_args(["serve"]).port == 8000  # the declared default
