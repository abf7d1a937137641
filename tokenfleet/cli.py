"""The `tokenfleet` command. Flags and environment variables are read here and in envs.py."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

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


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenfleet.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenfleet.server.app import create_app
    from tokenfleet.server.settings import BatchConfig, ServeConfig

    keys = set(args.api_key or [])
    if args.api_keys_file:
        lines = Path(args.api_keys_file).read_text().splitlines()
        keys |= {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    cache = CacheConfig(
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    scheduler = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
    )
    engine = EngineConfig(
        model=args.model or None,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.num_threads,
        max_model_len=args.max_model_len,
        runner=args.runner,
        cache=cache,
        scheduler=scheduler,
    )
    try:
        config = ServeConfig(
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            api_keys=frozenset(keys),
            max_body_bytes=args.max_body_bytes,
            ttft_target_s=args.ttft_target,
            engine=engine,
            batch=BatchConfig(
                data_dir=args.data_dir,
                database_url=args.database_url or None,
                gateway_id=args.gateway_id or f"{socket.gethostname()}:{args.port}",
                max_batch_requests=args.max_batch_requests,
                max_batch_bytes=args.max_batch_bytes,
                batch_expiry_s=args.batch_expiry,
                lease_s=args.lease_seconds,
                retention_s=args.batch_retention,
            ),
        )
    except ValueError as exc:
        print(f"tokenfleet serve: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level="info",
        # A log line per request costs the one event loop ~3% of its time under load;
        # request ids, statuses and latencies are in /metrics and in the error bodies.
        access_log=args.access_log,
    )
    return 0


def _add_serve(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    serve = commands.add_parser(
        "serve",
        help="serve the Anthropic and OpenAI APIs over HTTP",
        description="Start the HTTP gateway and one local engine process.",
        epilog=_env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = serve.add_argument
    num_threads = envs.num_threads()
    add("--host", default=envs.get("TOKENFLEET_HOST"), help="listen address (default %(default)s)")
    add("--port", type=int, default=int(envs.get("TOKENFLEET_PORT")), help="(default %(default)s)")
    add(
        "--model",
        default=envs.get("TOKENFLEET_MODEL"),
        help="Hugging Face folder (default: bundled)",
    )
    add("--served-model-name", default="smollm2-135m-instruct", help="the `model` callers send")
    add(
        "--api-key",
        action="append",
        default=[envs.get("TOKENFLEET_API_KEY")] if envs.get("TOKENFLEET_API_KEY") else None,
        help="accept this key (repeatable); without keys the server binds only to loopback",
    )
    add(
        "--api-keys-file",
        default=envs.get("TOKENFLEET_API_KEYS_FILE") or None,
        help="keys, one a line",
    )
    add("--access-log", action="store_true", help="log a line per HTTP request (default off)")
    add("--max-body-bytes", type=int, default=8 * 2**20, help="request body limit (413 above)")
    add(
        "--ttft-target", type=float, default=2.0, help="seconds; predicted TTFT above it is refused"
    )
    add("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    add("--dtype", default="float32", help="float32 or bfloat16 (default %(default)s)")
    add("--num-threads", type=int, default=num_threads, help="torch threads for the engine")
    add("--max-model-len", type=int, default=None, help="context length cap")
    add("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    add("--kv-cache-memory", type=int, default=None, help="KV cache bytes (default: a fraction)")
    add("--kv-cache-memory-fraction", type=float, default=0.1, help="of free memory after loading")
    add("--no-prefix-caching", action="store_true", help="disable prefix caching")
    add("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    add("--max-num-seqs", type=int, default=64, help="sequences per step")
    add(
        "--batch-retention",
        type=float,
        default=29 * 24 * 3600.0,
        help="seconds a batch's results are kept after it was created (default 29 days)",
    )
    add(
        "--runner",
        choices=("model", "fixed"),
        default="model",
        help="fixed: answer a fixed token without running the model (plumbing tests only)",
    )
    add("--data-dir", type=_path, default=envs.data_dir(), help="batch store and files")
    add(
        "--database-url",
        default=envs.get("TOKENFLEET_DATABASE_URL"),
        help="batch store: postgresql://user:pass@host/db to share it (default: SQLite)",
    )
    add(
        "--gateway-id",
        default=None,
        help="this gateway's name among those sharing a store (default: host:port)",
    )
    add("--max-batch-requests", type=int, default=100_000, help="requests per batch at most")
    add(
        "--max-batch-bytes",
        type=int,
        default=256 * 2**20,
        help="batch body / input file limit (413 above)",
    )
    add("--batch-expiry", type=float, default=24 * 3600.0, help="seconds a batch may take")
    add("--lease-seconds", type=float, default=120.0, help="batch request lease, renewed")
    serve.set_defaults(func=_serve)


def _batch(args: argparse.Namespace) -> int:
    from tokenfleet import batch_client

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


def _add_batch(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    batch = commands.add_parser(
        "batch",
        help="submit a JSONL batch, follow it, fetch its results",
        description="Call a server's Anthropic Message Batches or OpenAI Batch API.",
        epilog=_env_help(),
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
    submit.add_argument("file", type=_path, help="one request a line")
    submit.add_argument("--idempotency-key", default=None, help="sent as Idempotency-Key")
    status = batch_commands.add_parser(
        "status", parents=[common], help="a batch's state and request counts"
    )
    status.add_argument("id", help="msgbatch_... (Anthropic) or batch_... (OpenAI)")
    results = batch_commands.add_parser(
        "results", parents=[common], help="write an ended batch's results as JSONL"
    )
    results.add_argument("id", help="msgbatch_... (Anthropic) or batch_... (OpenAI)")
    results.add_argument("-o", "--output", type=_path, required=True, help="the JSONL to write")
    batch.set_defaults(func=_batch)


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
    _add_serve(commands)
    _add_batch(commands)
    return parser


def _path(value: str) -> Path:
    return Path(value).expanduser()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
