"""`tokenfleet sim CONFIG.yaml`: run a config's fleet policies; the table, sim.json, sim.png."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _sim(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tokenfleet.sim.config import ConfigError, load_config, sampled
    from tokenfleet.sim.report import format_table, plot, summarize, write_json
    from tokenfleet.sim.run import simulate

    try:
        config = load_config(args.config)
        if args.sample is not None:
            config = sampled(config, args.sample)
    except (OSError, ConfigError) as exc:
        print(f"tokenfleet sim: {exc}", file=sys.stderr)
        return 2
    policies = [p for p in config.policies if not args.policy or p.name in args.policy]
    summaries = []
    for policy in policies:
        with tqdm(
            total=round(config.duration_s),
            desc=policy.name,
            unit="sim s",
            disable=args.quiet,
        ) as bar:

            def progress(now: float, bar: tqdm = bar) -> None:
                bar.update(round(now) - bar.n)

            result = simulate(config, policy, progress)
            bar.update(bar.total - bar.n)
        summaries.append(summarize(result, config.targets))
    print(format_table(summaries))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "sim.json", summaries)
    plot(args.out / "sim.png", summaries)
    print(f"wrote {args.out / 'sim.json'} and {args.out / 'sim.png'}")
    return 0


def add_sim_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sim = commands.add_parser(
        "sim",
        help="simulate a fleet on a virtual clock (the engine's own scheduler, a cost model)",
        description="Run the fleet simulator on a YAML config (see examples/sim/).",
    )
    sim.add_argument("config", type=Path, help="the YAML config")
    sim.add_argument(
        "--policy", action="append", help="only this fleet policy (repeatable; default all)"
    )
    sim.add_argument("--out", type=Path, default=Path("sim-out"), help="(default sim-out)")
    sim.add_argument(
        "--sample",
        type=int,
        metavar="K",
        help="simulate each policy's N replicas as K given K/N of the traffic, totals "
        "scaled back to N (overrides the config's sample_replicas)",
    )
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.set_defaults(func=_sim)
