"""`tokenfleet serve`'s fleet flags (replicas on Ray, failover, slow and fenced replicas,
draining and the autoscaler) and the FleetConfig made from them."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tokenfleet import envs
from tokenfleet.config import FleetConfig


def fleet_config(args: argparse.Namespace) -> FleetConfig | None:
    if args.replicas is None and args.ray_address is None and args.autoscale is None:
        return None
    up_cooldown_s, down_cooldown_s = args.autoscale_cooldown
    fleet = FleetConfig(
        replicas=args.replicas or (args.autoscale[0] if args.autoscale else 1),
        ray_address=args.ray_address,
        max_restarts=args.replica_restarts,
        replica_timeout_s=args.replica_timeout,
        max_moves=args.max_moves,
        threads_per_replica=args.num_threads,
        router=args.router.replace("-", "_"),
        drain_grace_s=args.drain_grace,
        fence_timeout_s=args.fence_timeout,
        slow_replica_factor=args.slow_replica_factor or None,
        autoscale=args.autoscale,
        autoscale_window_s=args.autoscale_window,
        autoscale_up_cooldown_s=up_cooldown_s,
        autoscale_down_cooldown_s=down_cooldown_s,
        autoscale_calm_windows=args.autoscale_calm_windows,
        autoscale_batch_settle_s=args.autoscale_batch_settle,
    )
    if fleet.autoscale is not None:
        from tokenfleet.cluster.autoscaling import autoscaler_config

        autoscaler_config(fleet)  # its settings checked now (a ValueError: exit 2)
    return fleet


def _autoscale(text: str) -> tuple[int, int]:
    from tokenfleet.fleet.autoscaler import parse_autoscale

    try:
        return parse_autoscale(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value

    return parse


def _at_least_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text!r}")
    return value


def _cooldowns(text: str) -> tuple[float, float]:
    try:
        up, down = (float(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"wants UP:DOWN seconds (e.g. 60:300), got {text!r}"
        ) from None
    if up < 0 or down < 0:
        raise argparse.ArgumentTypeError(f"cool-downs must be at least 0 s, got {text!r}")
    return up, down


def add_fleet_flags(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--replicas",
        type=int,
        default=int(envs.get("TOKENFLEET_REPLICAS") or 0) or None,
        help="engine replicas as Ray actors, on a local Ray instance (every socket on "
        "127.0.0.1) or on --ray-address; unset: one local engine process, no Ray",
    )
    add(
        "--ray-address",
        default=envs.get("TOKENFLEET_RAY_ADDRESS") or None,
        help="join this Ray cluster (`ray start --head` gives it) and place the replicas on "
        "its nodes; gateways that join one cluster share its replicas",
    )
    add(
        "--replica-restarts",
        type=int,
        default=3,
        help="times Ray restarts a replica that died (default %(default)s)",
    )
    add(
        "--replica-timeout",
        type=float,
        default=1.5,
        help="seconds without a beat from a replica before its requests move to another "
        "(default %(default)s)",
    )
    add(
        "--fence-timeout",
        type=float,
        default=10.0,
        help="seconds without a beat before a replica is fenced (nothing it sends is taken "
        "again) and Ray is asked to replace it; at least --replica-timeout "
        "(default %(default)s)",
    )
    add(
        "--slow-replica-factor",
        type=float,
        default=2.0,
        help="a replica whose average step time runs above this times the other replicas' "
        "median gets no new work until it recovers; 0 turns it off (default %(default)s)",
    )
    add(
        "--router",
        choices=("prefix", "least-loaded", "round-robin"),
        default="prefix",
        help="how interactive requests pick a replica: prefix-cache affinity and load "
        "(default), or the two baselines",
    )
    add(
        "--drain-grace",
        type=float,
        default=30.0,
        help="seconds a replica scaled away lets its requests end before they move to "
        "others (default %(default)s)",
    )
    add(
        "--autoscale",
        type=_autoscale,
        metavar="MIN:MAX",
        help="one autoscaler for the fleet keeps it within MIN to MAX replicas from its SLO "
        "attainment, queued prefill and batch deadlines (docs/fleet.md); off by default",
    )
    add(
        "--autoscale-window", type=_positive(float), default=60.0, help="its window, s (default 60)"
    )
    add(
        "--autoscale-cooldown",
        type=_cooldowns,
        default=(60.0, 300.0),
        metavar="UP:DOWN",
        help="seconds after a change before a scale-up, a scale-down (default 60:300)",
    )
    add(
        "--autoscale-calm-windows",
        type=_positive(int),
        default=5,
        help="calm windows in a row before a scale-down (default %(default)s)",
    )
    add(
        "--autoscale-batch-settle",
        type=_at_least_zero,
        default=30.0,
        help="seconds batch work waits for the replicas, their number unchanged, before its "
        "rate per replica is measured: an engine's first fill of batch prefills reads under "
        "the rate it keeps (default %(default)s)",
    )
    add(
        "--max-moves",
        type=int,
        default=3,
        help="times a request may move to another replica before it ends with an error "
        "(default %(default)s)",
    )
