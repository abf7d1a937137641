"""Ray's own multi-node test cluster (`ray.cluster_utils.Cluster`) on this machine, for the
fleet's tests: a head node and worker nodes, each a raylet of its own, every socket on
127.0.0.1 (../shared/RAY.md).

The drivers (pytest's and each gateway's) attach to the head, so removing a worker never
takes a driver's raylet away; each worker offers `REPLICA_RESOURCE` for the replicas it
may hold, the head none unless asked. Health checks are fast, so that a node
removed is known dead within about a second. Teardown leaves no process behind: every
process it started is gone, or it fails.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from support.live_server import HTTP_TIMEOUT_S, LiveServer, children, wait_gone, wait_until
from tokenfleet.cluster.placement import NAMESPACE, REPLICA_RESOURCE

# Before ray is imported anywhere in this process (only the functions below import it):
# else ray.init rewrites 127.0.0.1 to the machine's address and the driver retries
# forever (../shared/RAY.md). The gateways inherit it (live_server copies os.environ).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

LOOPBACK = "127.0.0.1"
OBJECT_STORE_BYTES = 80 * 2**20
# A node removed is dead to Ray within ~1 s, not ~15 s (they may misfire on a loaded
# machine: tests only).
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
TEARDOWN_TIMEOUT_S = 30.0


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, ...)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children(todo.pop()) - found:
            found.add(child)
            todo.append(child)
    return found


@dataclass
class RayTestCluster:
    cluster: Any  # ray.cluster_utils.Cluster
    tmp_dir: Path
    replica_nodes: list[Any] = field(default_factory=list)  # ray._private.node.Node

    @property
    def address(self) -> str:
        """The GCS address a gateway joins (`--ray-address`)."""
        return str(self.cluster.address)

    def add_replica_node(self, num_replicas: int) -> Any:
        """A worker node that can hold `num_replicas` replicas."""
        node = self.cluster.add_node(
            num_cpus=1,
            node_ip_address=LOOPBACK,
            include_dashboard=False,
            object_store_memory=OBJECT_STORE_BYTES,
            resources={REPLICA_RESOURCE: num_replicas},
        )
        self.replica_nodes.append(node)
        return node

    def node(self, node_id: str) -> Any:
        """The worker node of this id (hex, as GET /admin/fleet names a replica's node)."""
        for node in self.replica_nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no replica node {node_id}")

    def remove_node(self, node: Any) -> None:
        """Take a worker node down, its raylet and every process on it (Ray's graceful
        removal: the raylet is told to go)."""
        self.cluster.remove_node(node)
        self.replica_nodes.remove(node)

    @contextmanager
    def node_without(self, folder: Path) -> Iterator[str]:
        """A worker node (one replica's room) whose processes do not see `folder`'s
        contents: the node (support/ray_node.py) in a mount namespace of its own where an
        empty tmpfs covers the folder, as on a machine that lacks it. Yields the node's id
        (hex); afterwards the node and every process on it are gone."""
        resources = json.dumps({REPLICA_RESOURCE: 1})
        node = [sys.executable, str(Path(__file__).with_name("ray_node.py")), self.address]
        node += [resources, str(OBJECT_STORE_BYTES)]
        script = f'mount -t tmpfs tmpfs "{folder}" && exec "$@"'
        process = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *node],
            stdout=subprocess.PIPE,
            env=os.environ.copy(),
            start_new_session=True,
        )
        try:
            assert process.stdout is not None
            node_id = process.stdout.readline().decode().strip()
            assert node_id, f"the node did not start: {process.wait(TEARDOWN_TIMEOUT_S)}"
            wait_until(lambda: _alive(node_id), 60, "the node without the folder alive")
            yield node_id
        finally:
            pids = descendants(process.pid) | {process.pid}
            process.send_signal(signal.SIGTERM)
            process.wait(TEARDOWN_TIMEOUT_S)
            left = sorted(p for p in pids if not wait_gone(p, TEARDOWN_TIMEOUT_S))
            assert left == [], f"processes left by the node without {folder}: {left}"


def _alive(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


@contextmanager
def ray_cluster(
    tmp_dir: Path, replicas_per_node: list[int], head_replicas: int = 0
) -> Iterator[RayTestCluster]:
    """A head node (holding `head_replicas` replicas at most) plus one worker node per
    entry of `replicas_per_node` (the replicas it can hold), with this process connected
    as a driver in the fleet's namespace. Ray's files (sessions, sockets, logs, its
    address file) go under `tmp_dir`.

    Teardown: ray.shutdown(), then the cluster's; then every process started meanwhile
    that carries this cluster's RAY_TMPDIR (Ray's, the replicas, a gateway left) must be
    gone."""
    previous_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(tmp_dir)
    before = descendants(os.getpid())
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": LOOPBACK,
            "include_dashboard": False,
            "object_store_memory": OBJECT_STORE_BYTES,
            "resources": {REPLICA_RESOURCE: head_replicas} if head_replicas else {},
            "_system_config": FAST_HEALTH_CHECKS,
        },
    )
    try:
        test_cluster = RayTestCluster(cluster, tmp_dir)
        for num_replicas in replicas_per_node:
            test_cluster.add_replica_node(num_replicas)
        cluster.wait_for_nodes()
        # Not cluster.connect(): it would print every worker's log here.
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield test_cluster
    finally:
        started = {p for p in descendants(os.getpid()) - before if _runs_in(p, tmp_dir)}
        ray.shutdown()  # first: the other order raises on the head (../shared/RAY.md)
        cluster.shutdown()  # type: ignore[no-untyped-call]
        if previous_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous_tmpdir
        assert started, "no process of the cluster found: the check below could not fail"
        left = sorted(p for p in started if not wait_gone(p, TEARDOWN_TIMEOUT_S))
        assert left == [], f"processes left after the Ray cluster's teardown: {left}"


def _runs_in(pid: int, tmp_dir: Path) -> bool:
    """Whether the process has this cluster's RAY_TMPDIR in its environment (Ray's
    processes, the replicas, the gateways do; a server some other fixture started, or a
    process gone meanwhile, does not)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"RAY_TMPDIR={tmp_dir}".encode() in environ


# -- the fleet as a gateway shows it (GET /admin/fleet) ------------------------------------


def fleet_rows(server: LiveServer) -> list[dict[str, Any]]:
    """The gateway's GET /admin/fleet rows, one per replica, by id."""
    reply = httpx.get(f"{server.url}/admin/fleet", timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return sorted(reply.json()["replicas"], key=lambda row: row["id"])


def fleet_moves(server: LiveServer) -> int:
    """The gateway's count of requests moved to another replica (GET /admin/fleet), which
    /metrics also gives."""
    reply = httpx.get(f"{server.url}/admin/fleet", timeout=HTTP_TIMEOUT_S)
    moves = reply.json()["moves"]
    metrics = httpx.get(f"{server.url}/metrics", timeout=HTTP_TIMEOUT_S).text
    assert f"tokenfleet_fleet_request_moves_total {float(moves)}" in metrics
    return int(moves)


def wait_fleet_ready(
    server: LiveServer, num_replicas: int, timeout: float = 120
) -> list[dict[str, Any]]:
    """The rows once the gateway sees all `num_replicas` replicas ready."""

    def ready() -> list[dict[str, Any]] | None:
        rows = fleet_rows(server)
        if len(rows) == num_replicas and all(row["state"] == "ready" for row in rows):
            return rows
        return None

    rows = wait_until(ready, timeout, f"{num_replicas} replicas ready")
    assert rows is not None
    return rows


def ray_actor(replica_id: int, actor_id: str | None = None) -> dict[str, Any]:
    """Ray's own record of a replica's actor in its GCS table (State, NumRestarts, ...),
    found by name, or by `actor_id` (hex) once the name is gone with a dead actor."""
    import ray

    if actor_id is None:
        handle = ray.get_actor(f"replica-{replica_id}", namespace=NAMESPACE)
        actor_id = handle._actor_id.hex()
    return dict(ray._private.state.actors(actor_id))


def busiest(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The replica with the most of this gateway's requests (it has at least one)."""
    row = max(rows, key=lambda r: r["requests_from_this_gateway"])
    assert row["requests_from_this_gateway"] > 0, rows
    return row


# -- sockets ---------------------------------------------------------------------------------


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s local address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    host_order = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(host_order)


def is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def listening_sockets(pids: set[int]) -> dict[int, tuple[Any, int]]:
    """The listening TCP sockets (state 0A in /proc/net/tcp and tcp6) that these
    processes hold: inode -> (local address, port)."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    found: dict[int, tuple[Any, int]] = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == "0A" and inode in inodes:
                host, port = local.split(":")
                found[inode] = (_address(host), int(port, 16))
    return found
