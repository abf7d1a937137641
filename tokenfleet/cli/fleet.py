"""`tokenfleet fleet status|scale N`: a running gateway's fleet over HTTP (GET /admin/fleet,
POST /admin/fleet/scale), with the operator key when the gateway has keys."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tokenfleet import envs
from tokenfleet.cli.common import env_help

POLL_S = 0.5


class FleetCommandError(Exception):
    pass


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    import httpx

    headers = {}
    if args.operator_key:
        headers = {"x-api-key": args.operator_key, "authorization": f"Bearer {args.operator_key}"}
    try:
        reply = httpx.request(
            method, f"{args.url.rstrip('/')}{path}", json=body, headers=headers, timeout=30
        )
    except httpx.HTTPError as exc:
        raise FleetCommandError(f"{args.url}: {exc}") from exc
    if reply.status_code >= 400:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text
        raise FleetCommandError(f"{reply.status_code}: {message}")
    return reply.json()


def _table(fleet: dict[str, Any]) -> str:
    lines = [f"{'id':>4} {'state':<9} {'running':>7} {'waiting':>7} {'restarts':>8}  node"]
    for row in fleet["replicas"]:
        lines.append(
            f"{row['id']:>4} {row['state']:<9} {row['running']:>7} {row['waiting']:>7} "
            f"{row['restarts']:>8}  {row['node'][:12]}"
        )
    for drain in fleet.get("drains", []):
        lines.append(
            f"drain of replica {drain['id']}: {drain['state']}, {drain['seconds']:.2f} s, "
            f"{drain['moved']} requests moved"
        )
    return "\n".join(lines)


def _settled(fleet: dict[str, Any], num_replicas: int) -> bool:
    states = [row["state"] for row in fleet["replicas"]]
    return states.count("ready") == num_replicas and "draining" not in states


def _fleet(args: argparse.Namespace) -> int:
    try:
        if args.fleet_command == "scale":
            plan = _call(args, "POST", "/admin/fleet/scale", {"replicas": args.replicas})
            print(
                f"scaling to {plan['replicas']} replicas: added {plan['added']}, "
                f"kept {plan['kept']}, draining {plan['draining']}",
                flush=True,
            )
            if args.wait:
                deadline = time.monotonic() + args.timeout
                while not _settled(fleet := _call(args, "GET", "/admin/fleet"), args.replicas):
                    if time.monotonic() > deadline:
                        raise FleetCommandError(f"not settled within {args.timeout:g} s")
                    time.sleep(POLL_S)
                print(_table(fleet))
        else:
            print(_table(_call(args, "GET", "/admin/fleet")))
    except FleetCommandError as exc:
        print(f"tokenfleet fleet {args.fleet_command}: {exc}", file=sys.stderr)
        return 1
    return 0


def _replica_count(value: str) -> int:
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {count}")
    return count


def add_fleet_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fleet = commands.add_parser(
        "fleet",
        help="a running gateway's replicas: list them, scale them",
        description="Look at or scale the fleet of a gateway started with --replicas or "
        "--ray-address.",
        epilog=env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fleet_commands = fleet.add_subparsers(dest="fleet_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=envs.get("TOKENFLEET_URL"), help="(default %(default)s)")
    common.add_argument(
        "--operator-key",
        default=envs.get("TOKENFLEET_OPERATOR_KEY"),
        help="sent as x-api-key and Bearer (default: TOKENFLEET_OPERATOR_KEY)",
    )
    fleet_commands.add_parser("status", parents=[common], help="the replicas and their states")
    scale = fleet_commands.add_parser(
        "scale",
        parents=[common],
        help="aim for N replicas: new ones start, removed ones drain",
    )
    scale.add_argument("replicas", type=_replica_count, help="the number of replicas")
    scale.add_argument(
        "--wait",
        action="store_true",
        help="wait until N replicas are ready and no drain is left, then list them",
    )
    scale.add_argument(
        "--timeout", type=float, default=600.0, help="seconds --wait waits (default %(default)s)"
    )
    fleet.set_defaults(func=_fleet)
