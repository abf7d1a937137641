"""`tokenfleet model prepare`: the bundled GGUF converted into a Hugging Face folder."""

from __future__ import annotations

import argparse

from tokenfleet import envs
from tokenfleet.cli.common import env_help, path


def _prepare(args: argparse.Namespace) -> int:
    from tokenfleet.checkpoint.bundled import prepare_bundled_model

    cache = args.cache_dir or envs.cache_dir() / "models"
    folder = prepare_bundled_model(cache, progress=not args.quiet, force=args.force)
    print(folder)
    return 0


def add_model_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    model = commands.add_parser("model", help="manage the bundled model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser(
        "prepare",
        help="convert the bundled SmolLM2-135M-Instruct GGUF into a Hugging Face folder",
        epilog=env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prepare.add_argument("--cache-dir", type=path, default=None, help="where to write it")
    prepare.add_argument("--force", action="store_true", help="convert again even if present")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    prepare.set_defaults(func=_prepare)
