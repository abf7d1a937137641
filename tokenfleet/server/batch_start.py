"""The gateway's batch side started: the store, and the dispatcher that leases its requests
into the engines, as many as the replicas taking work now have sequence slots for (read
at each lease: a fleet grows and shrinks under it)."""

from __future__ import annotations

from functools import partial

from tokenfleet.batch.store import BatchStore
from tokenfleet.engine.replica_client import ReplicaClient
from tokenfleet.server.batch_input import ENDPOINTS
from tokenfleet.server.batch_state import BatchState
from tokenfleet.server.dispatcher import BatchDispatcher, DispatcherConfig, ResultFormats, Runner
from tokenfleet.server.keys import Owners
from tokenfleet.server.metrics import Metrics
from tokenfleet.server.openai_result_files import ResultFiles
from tokenfleet.server.service import GenerationService
from tokenfleet.server.settings import BatchConfig


async def start_batches(
    config: BatchConfig,
    service: GenerationService,
    client: ReplicaClient,
    metrics: Metrics,
    owners: Owners,
) -> BatchState:
    config.data_dir.mkdir(parents=True, exist_ok=True)
    store = BatchStore(config.url)
    runners: dict[str, Runner] = {path: partial(e.run, service) for path, e in ENDPOINTS.items()}
    dispatcher = BatchDispatcher(
        store,
        DispatcherConfig(
            owner=config.gateway_id,
            lease_s=config.lease_s,
            max_attempts=config.max_attempts,
            retention_s=config.retention_s,
        ),
        runners,
        ResultFormats(),
        ready=client.is_healthy,
        capacity=lambda: batch_capacity(client),
        engine_load=lambda: _batch_load(client),
        counted=lambda outcome, n: metrics.batch_results.labels(outcome=outcome).inc(n),
        on_finished=ResultFiles(store).register_soon,  # OpenAI batches' output/error files
        group_of=owners.group,
    )
    await dispatcher.start()
    return BatchState(config, store, dispatcher, owners=owners)


def _batch_load(client: ReplicaClient) -> tuple[int, int] | None:
    stats = client.stats
    if stats is None:
        return None
    return stats.num_running_by_class.get("batch", 0), stats.num_waiting_by_class.get("batch", 0)


def batch_capacity(client: ReplicaClient) -> tuple[int, int]:
    """The batch dispatcher's (depth, queue target) now, from the replicas taking work: a
    fleet grows and shrinks under it (a scale, the autoscaler, a death)."""
    states = [row["state"] for row in client.describe()]
    # Slow replicas take new work only when no other is ready (cluster/client.py). None at
    # all: the dispatcher leases nothing then (not ready); one engine always counts one.
    replicas = max(1, states.count("ready") or states.count("slow"))
    depth = config_depth(client, replicas)
    return depth, max(4, depth // 8)


def config_depth(client: ReplicaClient, replicas: int = 1) -> int:
    """Batch requests kept in the engines: their sequence slots, enough to keep them full."""
    return client.config.scheduler.max_num_seqs * replicas
