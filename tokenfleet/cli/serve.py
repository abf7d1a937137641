"""`tokenfleet serve`: its flags, read with envs.py, and the HTTP gateway's start.

Over 400 lines: most of it is the flag list itself (about fifty flags with their help),
which reads best as one list; the fleet's flags are serve_fleet.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
from pathlib import Path

from tokenfleet import envs
from tokenfleet.cli.common import env_help, path
from tokenfleet.cli.serve_fleet import add_fleet_flags, fleet_config
from tokenfleet.config import KV_CACHE_DTYPES


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenfleet.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenfleet.server.app import create_app
    from tokenfleet.server.connections import ReadDeadlines
    from tokenfleet.server.keys import KeyRefused, gather_keys
    from tokenfleet.server.limits import GroupLimits
    from tokenfleet.server.settings import BatchConfig, ServeConfig

    try:
        groups, operator_key = gather_keys(
            args.api_key or [],
            Path(args.api_keys_file) if args.api_keys_file else None,
            args.operator_key if args.operator_key is not None else None,
        )
    except (KeyRefused, OSError) as exc:
        print(f"tokenfleet serve: {exc}", file=sys.stderr)
        return 2
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
            fixed_step_s=args.fixed_step_time,
            fixed_prefill_s_per_token=args.fixed_prefill_time,
            cache=cache,
            scheduler=scheduler,
            tpot_target_s=args.tpot_target,
            harvest_margin=args.harvest_margin,
            min_prefill_chunk=args.min_prefill_chunk,
            batch_step_limit_s=args.batch_step_limit,
            scheduling_policy=args.scheduling_policy,
            overlap={"auto": None, "on": True, "off": False}[args.overlap],
        )
        config = ServeConfig(
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            api_keys=frozenset(groups),
            key_groups=tuple(groups.items()),
            operator_key=operator_key,
            limits=GroupLimits(
                max_concurrent=args.max_concurrent_requests_per_group,
                requests_per_minute=args.requests_per_minute_per_group,
                tokens_per_minute=args.tokens_per_minute_per_group,
            ),
            shared_limits=args.shared_limits,
            read_deadlines=ReadDeadlines(
                header_timeout_s=args.header_timeout,
                body_timeout_s=args.body_timeout,
                max_header_bytes=args.max_header_bytes,
            ),
            max_connections=args.max_connections,
            keep_alive_s=args.keep_alive_timeout,
            stream_stall_timeout_s=args.stream_stall_timeout,
            offload_body_bytes=args.offload_body_bytes,
            check_threads=args.check_threads,
            max_body_bytes=args.max_body_bytes,
            max_engine_requests_per_request=args.max_engine_requests_per_request,
            public_base_url=args.public_base_url,
            ttft_target_s=args.ttft_target,
            engine_start_timeout_s=args.engine_start_timeout,
            engine_restart_backoff_s=args.engine_restart_backoff,
            engine_restart_backoff_max_s=args.engine_restart_backoff_max,
            engine=engine,
            fleet=fleet_config(args),
            batch=BatchConfig(
                data_dir=args.data_dir,
                database_url=args.database_url or None,
                gateway_id=args.gateway_id or f"{socket.gethostname()}:{args.port}",
                max_batch_requests=args.max_batch_requests,
                max_batch_bytes=args.max_batch_bytes,
                batch_expiry_s=args.batch_expiry,
                lease_s=args.lease_seconds,
                retention_s=args.batch_retention,
                max_attempts=args.batch_max_attempts,
                max_queued_per_key=args.max_queued_batch_requests,
                max_file_bytes_per_key=args.max_stored_file_bytes,
            ),
        )
    except ValueError as exc:
        print(f"tokenfleet serve: {exc}", file=sys.stderr)
        return 2
    from tokenfleet.server.connections import protocol_class, raise_open_files_limit

    raise_open_files_limit(config.max_connections)
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
        # Deadlines on reading a request's headers and body (half-sent connections are
        # closed), a bound on its headers' size, and on connections open at once.
        http=protocol_class(config.read_deadlines),
        limit_concurrency=config.max_connections,
        timeout_keep_alive=config.keep_alive_s,  # type: ignore[arg-type]
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
        help="keys, one a line: `KEY` or `KEY GROUP` (a group shares rate limits and the "
        "prefix cache; a key alone is its own group); a blank line is refused",
    )
    add(
        "--operator-key",
        default=envs.get("TOKENFLEET_OPERATOR_KEY") or None,
        help="the key /metrics and admin routes need once keys are set; it must differ from "
        "every caller's key (and opens no API route)",
    )
    add(
        "--max-concurrent-requests-per-group",
        type=int,
        default=64,
        help="interactive requests of one key group running at once; 429 beyond (0: no "
        "limit) (default %(default)s)",
    )
    add(
        "--requests-per-minute-per-group",
        type=int,
        default=1200,
        help="interactive requests a minute per key group; 429 with retry-after beyond "
        "(0: no limit) (default %(default)s)",
    )
    add(
        "--tokens-per-minute-per-group",
        type=int,
        default=2_000_000,
        help="tokens a minute per key group, each engine request charged its prompt plus "
        "max_tokens when it starts (OpenAI's accounting; n choices: n requests); 429 beyond "
        "(0: no limit) (default %(default)s)",
    )
    add(
        "--shared-limits",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the three limits above in the batch store, so that the gateways sharing "
        "it (--database-url) allow each key group its limits once in all, not once each: a "
        "short store transaction per request and an UPDATE per engine request; while the "
        "store does not answer, each gateway holds the limits on its own (default: on when "
        "--database-url is PostgreSQL, off for SQLite, which is one gateway's)",
    )
    add(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds to send a request's line and headers; the connection is closed after "
        "(default %(default)s)",
    )
    add(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may pause; the connection is closed after "
        "(default %(default)s)",
    )
    add(
        "--max-header-bytes",
        type=int,
        default=64 * 1024,
        help="request line and headers together; 431 above (default %(default)s)",
    )
    add(
        "--max-connections",
        type=int,
        default=1024,
        help="connections open at once; a request beyond is a 503 (default %(default)s)",
    )
    add(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle kept-alive connection is held (default %(default)s)",
    )
    add(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        help="seconds a stream may wait on a reader that fell behind (the server's send "
        "buffer full) before it is aborted and its KV blocks freed (default %(default)s)",
    )
    add(
        "--offload-body-bytes",
        type=int,
        default=16 * 1024,
        help="generation bodies over this are checked and tokenized in a thread pool, off "
        "the event loop (default %(default)s)",
    )
    add(
        "--check-threads",
        type=int,
        default=2,
        help="threads that check and tokenize large bodies (default %(default)s)",
    )
    add("--access-log", action="store_true", help="log a line per HTTP request (default off)")
    add("--max-body-bytes", type=int, default=8 * 2**20, help="request body limit (413 above)")
    add(
        "--max-engine-requests-per-request",
        type=int,
        default=64,
        help="generations one request or batch line may ask for, prompts x n (400 above; "
        "default %(default)s)",
    )
    add(
        "--public-base-url",
        default=None,
        help="the URL clients reach this server at (behind a proxy), for the URLs it hands "
        "out; default: from X-Forwarded-Proto/-Host/-Prefix, else the request's own",
    )
    add(
        "--ttft-target", type=float, default=2.0, help="seconds; predicted TTFT above it is refused"
    )
    add(
        "--engine-start-timeout",
        type=float,
        default=600.0,
        help="seconds; an engine process not ready this long after its start is killed",
    )
    add(
        "--engine-restart-backoff",
        type=float,
        default=0.5,
        help="seconds before the second restart in a row of the engine; doubles each time",
    )
    add(
        "--engine-restart-backoff-max",
        type=float,
        default=60.0,
        help="seconds; the most the engine's restart backoff grows to",
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
    add_fleet_flags(serve.add_argument_group("fleet (Ray replicas, scaling)"))
    add(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="plan each engine step while the previous one's forward runs: auto (the "
        "default) is on for the fixed runner only (measured slower with the model, on a "
        "CPU and on a GPU: docs/benchmarks.md)",
    )
    add("--no-overlap", dest="overlap", action="store_const", const="off", help="--overlap off")
    add(
        "--runner",
        choices=("model", "fixed"),
        default="model",
        help="fixed: answer a fixed token without running the model (plumbing tests only)",
    )
    add(
        "--fixed-step-time",
        type=float,
        default=0.0,
        help="with --runner fixed: seconds each step takes (a sleep, as a forward would)",
    )
    add(
        "--fixed-prefill-time",
        type=float,
        default=0.0,
        help="with --runner fixed: seconds more a step takes per prefilled token",
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
    add(
        "--batch-max-attempts",
        type=int,
        default=3,
        help="times a batch request may fail through its own fault (its engine died while "
        "running it) before it ends errored; a gateway stop or lease expiry counts none",
    )
    add(
        "--max-queued-batch-requests",
        type=int,
        default=1_000_000,
        help="per key group: batch requests waiting to run at most (a create over it is a 429)",
    )
    add(
        "--max-stored-file-bytes",
        type=int,
        default=16 * 2**30,
        help="per key group: bytes of uploaded files kept at most (an upload over it is a "
        "429; delete files to make room; default 16 GiB)",
    )
    serve.set_defaults(func=_serve)
