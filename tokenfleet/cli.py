"""The `tokenfleet` command. Flags and environment variables are read here and in envs.py."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenfleet import envs


def _env_help() -> str:
    lines = ["environment variables:"]
    for name, (default, meaning) in envs.ENVIRONMENT_VARIABLES.items():
        lines.append(f"  {name:<24} {meaning} (default: {default or 'unset'})")
    return "\n".join(lines)


def _prepare(args: argparse.Namespace) -> int:
    from tokenfleet.bundled_model import prepare_bundled_model

    cache = args.cache_dir or envs.cache_dir() / "models"
    folder = prepare_bundled_model(cache, progress=not args.quiet, force=args.force)
    print(folder)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenfleet",
        description="Serve one LLM to interactive and batch callers.",
        epilog=_env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("model", help="manage the bundled model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser(
        "prepare",
        help="convert the bundled SmolLM2-135M-Instruct GGUF into a Hugging Face folder",
        epilog=_env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prepare.add_argument("--cache-dir", type=_path, default=None, help="where to write it")
    prepare.add_argument("--force", action="store_true", help="convert again even if present")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    prepare.set_defaults(func=_prepare)
    return parser


def _path(value: str) -> object:
    from pathlib import Path

    return Path(value).expanduser()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
