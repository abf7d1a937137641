"""`tokenfleet serve`: its flags, read with envs.py, and the HTTP gateway's start."""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
from pathlib import Path

from tokenfleet import envs
from tokenfleet.cli.common import env_help, path
from tokenfleet.config import KV_CACHE_DTYPES


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


def add_serve_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    serve = commands.add_parser(
        "serve",
        help="serve the Anthropic and OpenAI APIs over HTTP",
        description="Start the HTTP gateway and one local engine process.",
        epilog=env_help(),
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
    add("--data-dir", type=path, default=envs.data_dir(), help="batch store and files")
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
