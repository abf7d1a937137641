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


def test_autoscale_flags_reach_the_autoscalers_settings() -> None:
    from tokenfleet.cli.serve_fleet import fleet_config
    from tokenfleet.cluster.autoscaling import autoscaler_config

    flags = ["serve", "--autoscale", "2:6", "--autoscale-window", "30"]
    flags += ["--autoscale-cooldown", "10:90", "--autoscale-calm-windows", "3"]
    fleet = fleet_config(build_parser().parse_args([*flags, "--autoscale-batch-settle", "0"]))
    assert fleet is not None
    config = autoscaler_config(fleet)
    assert (config.min_replicas, config.max_replicas, config.window_s) == (2, 6, 30.0)
    assert (config.up_cooldown_s, config.down_cooldown_s, config.down_windows) == (10, 90, 3)
    assert config.batch_settle_s == 0.0
    default = fleet_config(build_parser().parse_args(flags))
    assert default is not None and autoscaler_config(default).batch_settle_s == 30.0
    with pytest.raises(SystemExit):
        build_parser().parse_args([*flags, "--autoscale-batch-settle", "-1"])
