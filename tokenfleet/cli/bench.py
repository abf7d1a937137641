"""`tokenfleet bench`: interactive + batch load against an endpoint, its table and bench.json."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tokenfleet import envs
from tokenfleet.cli.common import env_help, path


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


def add_bench_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = commands.add_parser(
        "bench",
        help="measure an Anthropic- or OpenAI-compatible endpoint under interactive + batch load",
        description=(
            "Poisson interactive arrivals plus a batch submitted at the start, against any "
            "endpoint (tokenfleet, vLLM, llama-server); TTFT, TPOT, tokens/s and goodput per "
            "class as a table, bench.json and bench.png."
        ),
        epilog=env_help(),
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
        type=path,
        default=Path("bench-out"),
        help="folder for bench.json, bench.png (default bench-out)",
    )
    add("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(func=_bench)
