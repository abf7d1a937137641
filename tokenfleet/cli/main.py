"""The `tokenfleet` command: the top-level parser and dispatch; a module per subcommand."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenfleet.cli.batch import add_batch_command
from tokenfleet.cli.bench import add_bench_command
from tokenfleet.cli.common import env_help
from tokenfleet.cli.fleet import add_fleet_command
from tokenfleet.cli.model import add_model_command
from tokenfleet.cli.serve import add_serve_command
from tokenfleet.cli.sim import add_sim_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenfleet",
        description="Serve one LLM to interactive and batch callers.",
        epilog=env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_model_command(commands)
    add_serve_command(commands)
    add_batch_command(commands)
    add_fleet_command(commands)
    add_bench_command(commands)
    add_sim_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
