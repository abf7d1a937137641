"""A Ray worker node as a process of its own: what `ray.cluster_utils.Cluster.add_node`
starts inside the test process, started here so that a test can run it somewhere else (in
a mount namespace of its own). `ray start --address` cannot stand in: it refuses to join
with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and with 1 it dials the GCS at the machine's
address instead of 127.0.0.1 (../shared/RAY.md).

    python ray_node.py GCS_ADDRESS RESOURCES_JSON OBJECT_STORE_BYTES

prints the node's id (hex) once it has joined, then runs until SIGTERM, which takes its
raylet and every process of the node down.
"""

from __future__ import annotations

import json
import os
import signal
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported

from ray._private.node import Node
from ray._private.parameter import RayParams


def main() -> None:
    gcs_address, resources, object_store_bytes = sys.argv[1:]
    params = RayParams(
        gcs_address=gcs_address,
        node_ip_address="127.0.0.1",
        num_cpus=1,
        num_gpus=0,
        resources=json.loads(resources),
        object_store_memory=int(object_store_bytes),
        include_dashboard=False,
        include_log_monitor=False,
        node_manager_port=0,
        min_worker_port=0,
        max_worker_port=0,
    )
    params.dashboard_agent_listen_port = None
    stop = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_sigterm)
    node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    print(node.node_id, flush=True)
    while not stop:
        signal.pause()
    node.kill_all_processes(check_alive=False, allow_graceful=True)


if __name__ == "__main__":
    main()
