"""The `tokenfleet` command. Flags and environment variables are read here and in envs.py."""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
from pathlib import Path

from tokenfleet import envs
from tokenfleet.cli.sim import add_sim_command
from tokenfleet.config import KV_CACHE_DTYPES


def _env_help() -> str:
    lines = ["environment variables:"]
    for name, (default, meaning) in envs.ENVIRONMENT_VARIABLES.items():
        lines.append(f"  {name:<24} {meaning} (default: {default or 'unset'})")
    return "\n".join(lines)


def _prepare(args: argparse.Namespace) -> int:
    from tokenfleet.checkpoint.bundled import prepare_bundled_model

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
    try:
        cache = CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        scheduler = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        )
        engine = EngineConfig(
            model=args.model or None,
            device=args.device,
            dtype=args.dtype,
            num_threads=args.num_threads,
            max_model_len=args.max_model_len,
            linear_backend=args.linear_backend,
            runner=args.runner,
            cache=cache,
            scheduler=scheduler,
            tpot_target_s=args.tpot_target,
            harvest_margin=args.harvest_margin,
            min_prefill_chunk=args.min_prefill_chunk,
            batch_step_limit_s=args.batch_step_limit,
            scheduling_policy=args.scheduling_policy,
        )
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
    app = create_app(config)
    server_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        # A log line per request costs the one event loop ~3% of its time under load;
        # request ids, statuses and latencies are in /metrics and in the error bodies.
        access_log=args.access_log,
        # The client's address is not used (no per-address limits or logs by default): no
        # X-Forwarded-* parsing on every request.
        proxy_headers=False,
    )
    server = uvicorn.Server(server_config)
    # The gateway counts the requests uvicorn has taken in and not yet sent to the engine.
    app.state.server_tasks = server.server_state.tasks
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run
        server.run()
    # As uvicorn.run: a server that never started (the port taken, the lifespan failed).
    return 0 if server.started else 3


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
    add(
        "--tpot-target",
        type=float,
        default=0.06,
        help="seconds; batch joins a step beside interactive streams only while its "
        "predicted time stays within this, less the margin (default %(default)s)",
    )
    add(
        "--harvest-margin",
        type=float,
        default=0.1,
        help="fraction of --tpot-target kept spare for misprediction (default %(default)s)",
    )
    add(
        "--min-prefill-chunk",
        type=int,
        default=16,
        help="prompt tokens a step at least beside running streams whose decodes alone are "
        "over the harvest limit, so that a prompt keeps moving: never beyond the TPOT target "
        "itself (then fewer, at least 1); within the limit a prompt gets what fits, at least "
        "1 (default %(default)s)",
    )
    add(
        "--batch-step-limit",
        type=float,
        default=None,
        help="seconds; a step of batch work alone is kept within this, since an interactive "
        "request that arrives meanwhile waits for it (default: no limit, throughput first)",
    )
    add(
        "--scheduling-policy",
        choices=("priority", "fcfs"),
        default="priority",
        help="priority: interactive first, batch in the harvest budget; fcfs: arrival order "
        "(vLLM's default, for comparisons) (default %(default)s)",
    )
    add("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    add("--dtype", default="float32", help="float32 or bfloat16 (default %(default)s)")
    add("--num-threads", type=int, default=num_threads, help="torch threads for the engine")
    add(
        "--linear-backend",
        choices=("auto", "torch", "onednn"),
        default="auto",
        help="CPU float32 linear layers: torch's BLAS or oneDNN's packed weights; auto: "
        "whichever a timing at start-up finds faster (default %(default)s)",
    )
    add("--max-model-len", type=int, default=None, help="context length cap")
    add("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    add("--kv-cache-memory", type=int, default=None, help="KV cache bytes (default: a fraction)")
    add("--kv-cache-memory-fraction", type=float, default=0.1, help="of free memory after loading")
    add(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="K/V element type: auto (the model's) or 16 bits, twice the tokens a byte and "
        "half the bytes read per token of context (default %(default)s)",
    )
    add("--no-prefix-caching", action="store_true", help="disable prefix caching")
    add("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    add("--max-num-seqs", type=int, default=64, help="sequences per step")
    add(
        "--long-prefill-token-threshold",
        type=int,
        default=128,
        help="while interactive prompts wait, a running one takes at most this many tokens "
        "a step before they are served, so that a long prompt does not hold short ones back "
        "(0: off; off under fcfs) (default %(default)s)",
    )
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


def _bench(args: argparse.Namespace) -> int:
    import httpx

    from tokenfleet.loadgen.run import BenchConfig, bench
    from tokenfleet.loadgen.workload import WorkloadConfig

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        config = BenchConfig(
            url=args.url,
            out=args.out,
            api=args.api,
            model=args.model,
            api_key=args.api_key or None,
            batch_mode=args.batch_mode,
            batch_concurrency=args.batch_concurrency,
            batch_priority=args.batch_priority or None,
            ttft_target_s=args.ttft_target,
            tpot_target_s=args.tpot_target,
            ignore_eos=args.ignore_eos,
            timeout_s=args.timeout,
            drain_s=args.drain,
            progress=not args.quiet,
            workload=WorkloadConfig(
                rate=args.rate,
                duration_s=args.duration,
                num_batch=args.num_batch,
                max_model_len=args.max_model_len,
                prompt_len_median=args.prompt_len_median,
                output_len_median=args.output_len_median,
                length_dist=args.length_dist,
                length_tail=args.length_tail,
                shared_prefix_tokens=args.shared_prefix_tokens,
                seed=args.seed,
            ),
        )
    except ValueError as exc:
        print(f"tokenfleet bench: {exc}", file=sys.stderr)
        return 2
    try:
        result, table = bench(config)
    except httpx.HTTPError as exc:  # the endpoint's model list: nothing ran
        print(f"tokenfleet bench: cannot ask {args.url} for its model: {exc}", file=sys.stderr)
        return 1
    print(
        f"{config.api} API at {result.endpoint.url}, model {result.endpoint.model}, "
        f"batch mode {result.batch_mode}, {result.elapsed_s:.1f} s"
    )
    print(table)
    print(f"wrote {config.out / 'bench.json'}")
    return 0


def _add_bench(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = commands.add_parser(
        "bench",
        help="measure an Anthropic- or OpenAI-compatible endpoint under interactive + batch load",
        description=(
            "Poisson interactive arrivals plus a batch submitted at the start, against any "
            "endpoint (tokenfleet, vLLM, llama-server); TTFT, TPOT, tokens/s and goodput per "
            "class as a table, bench.json and bench.png."
        ),
        epilog=_env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = bench.add_argument
    add("--url", default=envs.get("TOKENFLEET_URL"), help="without /v1 (default %(default)s)")
    add("--api", choices=("openai", "anthropic"), default="openai", help="(default %(default)s)")
    add("--model", default=None, help="the `model` to send (default: the first of /v1/models)")
    add("--api-key", default=envs.get("TOKENFLEET_API_KEY"), help="sent as x-api-key and Bearer")
    add("--rate", type=float, default=1.0, help="interactive requests/s, Poisson (default 1)")
    add("--duration", type=float, default=60.0, help="seconds of interactive arrivals (default 60)")
    add(
        "--drain",
        type=float,
        default=300.0,
        help="seconds after --duration to finish, at most (default 300)",
    )
    add(
        "--num-batch", type=int, default=0, help="batch requests submitted at the start (default 0)"
    )
    add(
        "--batch-mode",
        choices=("auto", "api", "concurrent", "none"),
        default="auto",
        help="api: the Batch API; concurrent: streamed at low priority; auto: api where the "
        "endpoint lists batches (default)",
    )
    add(
        "--batch-concurrency",
        type=int,
        default=64,
        help="concurrent mode: requests in flight (default 64)",
    )
    add(
        "--batch-priority",
        type=int,
        default=1,
        help="concurrent mode: the body's `priority` (vLLM: higher runs later, and a server "
        "without --scheduling-policy priority refuses it; 0: not sent; default 1)",
    )
    add(
        "--max-model-len",
        type=int,
        default=8192,
        help="prompt + output stay within it (default 8192)",
    )
    add("--prompt-len-median", type=int, default=512, help="tokens (default %(default)s)")
    add("--output-len-median", type=int, default=128, help="tokens (default %(default)s)")
    add(
        "--length-dist",
        choices=("lognormal", "pareto"),
        default="lognormal",
        help="(default lognormal)",
    )
    add(
        "--length-tail",
        type=float,
        default=1.0,
        help="lognormal sigma or Pareto alpha (smaller: heavier tail; default 1); lengths in "
        "[4, 16000]",
    )
    add("--shared-prefix-tokens", type=int, default=0, help="a prompt start all requests share")
    add("--seed", type=int, default=0, help="(default %(default)s)")
    add("--ttft-target", type=float, default=2.0, help="seconds, for goodput (default 2)")
    add("--tpot-target", type=float, default=0.06, help="seconds, for goodput (default 0.06)")
    add(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so that outputs are exactly the sampled lengths (default on)",
    )
    add("--timeout", type=float, default=600.0, help="seconds per streamed request (default 600)")
    add(
        "--out",
        type=_path,
        default=Path("bench-out"),
        help="folder for bench.json, bench.png (default bench-out)",
    )
    add("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(func=_bench)


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
    _add_bench(commands)
    add_sim_command(commands)
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
