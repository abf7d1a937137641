"""`tokenfleet batch submit|status|results`: a server's Batch APIs through the batch client."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenfleet import envs
from tokenfleet.cli.common import env_help, path


def _batch(args: argparse.Namespace) -> int:
    from tokenfleet.client import batch as batch_client

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    try:
        with batch_client.BatchClient(args.url, args.api_key or None) as client:
            if args.batch_command in ("submit", "status"):
                if args.batch_command == "submit":
                    batch_id = client.submit(args.file, idempotency_key=args.idempotency_key)
                    print(batch_id, flush=True)
                else:
                    batch_id = args.id
                status = client.wait(batch_id) if args.wait else client.status(batch_id)
                if status.failed:  # an OpenAI batch is refused as a whole after its creation
                    raise batch_client.BatchError(status.describe())
                if args.wait or args.batch_command == "status":
                    print(status.describe())
            else:
                if args.wait:
                    client.wait(args.id)
                num_lines = client.write_results(args.id, args.output)
                print(f"wrote {num_lines} lines to {args.output}")
    except batch_client.UsageError as exc:
        print(f"tokenfleet batch {args.batch_command}: {exc}", file=sys.stderr)
        return 2
    except batch_client.BatchError as exc:
        print(f"tokenfleet batch {args.batch_command}: {exc}", file=sys.stderr)
        return 1
    return 0


def add_batch_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    batch = commands.add_parser(
        "batch",
        help="submit a JSONL batch, follow it, fetch its results",
        description="Call a server's Anthropic Message Batches or OpenAI Batch API.",
        epilog=env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    batch_commands = batch.add_subparsers(dest="batch_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=envs.get("TOKENFLEET_URL"), help="(default %(default)s)")
    common.add_argument(
        "--api-key",
        default=envs.get("TOKENFLEET_API_KEY"),
        help="sent as x-api-key and Bearer (default: TOKENFLEET_API_KEY)",
    )
    common.add_argument("--wait", action="store_true", help="wait until the batch has ended")
    submit = batch_commands.add_parser(
        "submit",
        parents=[common],
        help="create a batch from a JSONL file of Anthropic or OpenAI batch requests",
    )
    submit.add_argument("file", type=path, help="one request a line")
    submit.add_argument("--idempotency-key", default=None, help="sent as Idempotency-Key")
    status = batch_commands.add_parser(
        "status", parents=[common], help="a batch's state and request counts"
    )
    status.add_argument("id", help="msgbatch_... (Anthropic) or batch_... (OpenAI)")
    results = batch_commands.add_parser(
        "results", parents=[common], help="write an ended batch's results as JSONL"
    )
    results.add_argument("id", help="msgbatch_... (Anthropic) or batch_... (OpenAI)")
    results.add_argument("-o", "--output", type=path, required=True, help="the JSONL to write")
    batch.set_defaults(func=_batch)
