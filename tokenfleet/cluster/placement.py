"""Ray itself: a local instance (`serve --replicas N`) or an operator's cluster
(`--ray-address`), the replica actors on it, and finding them by name.

Every Ray socket binds 127.0.0.1 for a local instance (node_ip_address, and
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before ray is imported, else Ray rewrites the address
and the driver retries forever: ../shared/RAY.md); no dashboard; a small object store (no
object of ours goes through it). Replicas are detached, named actors in the "tokenfleet"
namespace, so that any gateway finds them and none takes them down by dying; Ray restarts
one that dies up to `max_restarts` times. Scaling (scaling.py) adds replicas by the next
free id, flags one draining (every gateway reads the flag) and stops one for good.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tokenfleet.config import EngineConfig, FleetConfig
from tokenfleet.errors import TokenfleetError

logger = logging.getLogger(__name__)

NAMESPACE = "tokenfleet"
REPLICA_PREFIX = "replica-"
# The resource a CPU node offers per replica it can hold (GPU nodes: num_gpus=1 instead).
REPLICA_RESOURCE = "tokenfleet_replica"
OBJECT_STORE_BYTES = 100 * 2**20
# Replicas a local instance has room for (a logical resource: `serve --replicas N` starts N,
# scaling by hand may add more; memory and cores are the operator's to judge).
LOCAL_REPLICA_ROOM = 64


# A bound on a Ray call that flags a replica draining (it answers at once unless stuck).
DIRECTORY_CALL_S = 10.0


class ClusterError(TokenfleetError):
    """The fleet cannot start as asked (a missing model folder on a node, no room)."""


@dataclass(frozen=True)
class ReplicaDescription:
    replica_id: int
    incarnation: int
    address: str
    node: str
    pid: int
    ready: bool
    draining: bool = False  # flagged by a gateway that scales it away: no new work


def import_ray() -> Any:
    """Ray, imported with every socket kept where it is told to bind."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    return ray


def replica_name(replica_id: int) -> str:
    return f"{REPLICA_PREFIX}{replica_id}"


class RayFleet:
    """The replicas on Ray, from a gateway's side. `start` (blocking: run it in a thread)
    joins or starts Ray and creates the replicas that are not there yet."""

    def __init__(self, spec: FleetConfig, engine: EngineConfig) -> None:
        self.spec = spec
        self.engine = engine
        self.gpus = engine.device.startswith("cuda")  # one GPU a replica, else the resource
        self._ray: Any = None
        self._started_ray = False
        self._handles: dict[int, Any] = {}
        self._removed: set[int] = set()  # stopped for good by this gateway
        self._actor_class: Any = None
        self._config_json = b""

    @property
    def host(self) -> str:
        """The address replicas reach this gateway at: its node's, as Ray knows it."""
        return str(self._ray.util.get_node_ip_address())

    def start(self) -> None:
        ray = self._ray = import_ray()
        spec = self.spec
        if not ray.is_initialized():
            if spec.ray_address is None:
                ray.init(
                    num_cpus=max(2, spec.replicas),
                    resources={REPLICA_RESOURCE: max(spec.replicas, LOCAL_REPLICA_ROOM)},
                    object_store_memory=OBJECT_STORE_BYTES,
                    include_dashboard=False,
                    namespace=NAMESPACE,
                    _node_ip_address="127.0.0.1",
                    log_to_driver=True,
                )
                self._started_ray = True
            else:
                ray.init(address=spec.ray_address, namespace=NAMESPACE, log_to_driver=True)
        if self.engine.model is not None:
            self.check_model_on_nodes(self.engine.model)
        # By name: the gateway never imports the engine (torch); only the actor's process does.
        replica = importlib.import_module("tokenfleet.cluster.replica")
        self._actor_class = ray.remote(replica.ReplicaActor)
        engine = self.engine
        if not self.gpus and engine.num_threads is None:
            # The node's cores shared among its replicas (all of them, on a local instance).
            threads = spec.threads_per_replica or max(1, (os.cpu_count() or 1) // spec.replicas)
            engine = dataclasses.replace(engine, num_threads=threads)
        self._config_json = msgspec.json.encode(engine)
        for replica_id in range(spec.replicas):
            self.add(replica_id)
        logger.info("%d replicas on Ray (%s)", spec.replicas, spec.ray_address or "local")

    def add(self, replica_id: int) -> None:
        """Create the replica actor of this id unless it runs already (any gateway's)."""
        spec = self.spec
        self._removed.discard(replica_id)
        self._handles[replica_id] = self._actor_class.options(
            name=replica_name(replica_id),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=spec.max_restarts,
            max_task_retries=0,
            num_cpus=0,
            num_gpus=1 if self.gpus else 0,
            resources={} if self.gpus else {REPLICA_RESOURCE: 1},
        ).remote(replica_id, self._config_json, spec.beat_interval_s, spec.gateway_timeout_s)

    def set_draining(self, replica_id: int, draining: bool) -> None:
        """Flag the replica draining (or not): every gateway reads it in `describe`."""
        handle = self.handles().get(replica_id)
        if handle is not None:
            self._ray.get(handle.drain.remote(draining), timeout=DIRECTORY_CALL_S)

    def remove(self, replica_id: int) -> None:
        """Stop the replica for good (drained): Ray does not restart it, and its name is
        free for a later scale-up."""
        handle = self.handles().pop(replica_id, None)
        self._handles.pop(replica_id, None)
        self._removed.add(replica_id)
        if handle is not None:
            self._ray.kill(handle, no_restart=True)

    def check_model_on_nodes(self, model: str) -> None:
        """Every node that can hold a replica has the model folder, or a clear error."""
        ray = self._ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        key = "GPU" if self.gpus else REPLICA_RESOURCE
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(key)]
        check = ray.remote(num_cpus=0)(_has_model_folder)
        refs = [
            check.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(model)
            for n in nodes
        ]
        missing = [
            f"{n['NodeManagerAddress']} ({n['NodeID'][:12]})"
            for n, ok in zip(nodes, ray.get(refs, timeout=60), strict=True)
            if not ok
        ]
        if missing:
            raise ClusterError(
                f"the model folder {model!r} (config.json and weights) is missing on "
                f"node(s) {', '.join(missing)}: every node that can hold a replica needs it"
            )

    def handles(self) -> dict[int, Any]:
        """Every replica actor by id, the ones other gateways created included."""
        ray = self._ray
        for name in ray.util.list_named_actors():
            if name.startswith(REPLICA_PREFIX) and name[len(REPLICA_PREFIX) :].isdigit():
                replica_id = int(name[len(REPLICA_PREFIX) :])
                if replica_id not in self._handles and replica_id not in self._removed:
                    self._handles[replica_id] = ray.get_actor(name, namespace=NAMESPACE)
        return dict(self._handles)

    async def describe(self, timeout_s: float) -> dict[int, ReplicaDescription | str]:
        """Each replica's description, or why there is none: "restarting", "dead" (Ray
        used up its restarts) or "silent" (no answer within `timeout_s`: starting, or
        frozen)."""
        ray = self._ray
        handles = await asyncio.to_thread(self.handles)

        async def one(handle: Any) -> ReplicaDescription | str:
            try:
                ref = handle.describe.remote()
                found = await asyncio.wait_for(_awaitable(ref), timeout_s)
            except TimeoutError:
                return "silent"
            except ray.exceptions.ActorDiedError:
                return "dead"
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
                return "restarting"
            return ReplicaDescription(**found)

        results = await asyncio.gather(*(one(h) for h in handles.values()))
        found = dict(zip(handles, results, strict=True))
        for replica_id, result in found.items():
            if result == "dead":  # its name is free: a later actor of that name is found anew
                self._handles.pop(replica_id, None)
        return found

    def restart(self, replica_id: int) -> None:
        """Kill the replica's process so that Ray starts it again (a restart counts
        against its max_restarts), whatever state it is in."""
        handle = self.handles().get(replica_id)
        if handle is not None:
            self._ray.kill(handle, no_restart=False)

    def shutdown(self) -> None:
        """Leave an operator's cluster as it is (its replicas serve other gateways); take a
        local instance down with its replicas."""
        ray = self._ray
        if ray is None:
            return
        if self._started_ray:
            for handle in self._handles.values():
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # already gone
                    logger.debug("replica already gone", exc_info=True)
        ray.shutdown()


def _has_model_folder(model: str) -> bool:
    folder = Path(model)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _awaitable(ref: Any) -> Awaitable[Any]:
    return asyncio.wrap_future(ref.future())
