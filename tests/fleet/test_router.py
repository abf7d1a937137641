"""The fleet's router (fleet/router.py) and its TTFT guard (fleet/ttft.py): one class for
the simulator and the live fleet, checked here on its own, step by step."""

from __future__ import annotations

import math

import pytest

from tokenfleet.config import EngineConfig
from tokenfleet.core.engine_api import SchedulerStats
from tokenfleet.fleet.router import Router, RouterConfig
from tokenfleet.fleet.ttft import ReplicaTTFT

BLOCK = 16
SYSTEM_A = list(range(1000, 1000 + 4 * BLOCK))  # four full blocks
SYSTEM_B = list(range(2000, 2000 + 4 * BLOCK))


def router(policy: str = "prefix", replicas: int = 2, **kwargs: object) -> Router:
    r = Router(RouterConfig(policy=policy, **kwargs), BLOCK)  # type: ignore[arg-type]
    for i in range(replicas):
        r.add_replica(i)
    return r


def test_a_shared_prefix_goes_where_it_went_before() -> None:
    r = router()
    first, uncached = r.route([*SYSTEM_A, 1, 2, 3], [0, 1])
    assert (first, uncached) == (0, 4 * BLOCK + 3)
    # Before its prefill, the tokens queued there weigh more than the hit would save.
    assert r.route([*SYSTEM_A, 4, 5], [0, 1]) == (1, 4 * BLOCK + 2)
    r.prefilled(0, uncached)
    r.prefilled(1, 4 * BLOCK + 2)
    r.finished(1)
    r.finished(0)
    # Both hold it now: the less loaded one. Prefilled, a held prefix is worth more than
    # a running request more.
    assert r.route([*SYSTEM_A, 7, 8], [0, 1]) == (0, 2)
    r.prefilled(0, 2)
    assert r.route([*SYSTEM_A, 7, 9], [0, 1]) == (1, 2)
    r.prefilled(1, 2)
    assert r.route([*SYSTEM_A, 6], [0, 1]) == (0, 1)
    assert r.route([*SYSTEM_B, 9], [0, 1]) == (1, 4 * BLOCK + 1)


def test_another_key_groups_equal_prompt_is_not_taken_for_cached() -> None:
    r = router()
    assert r.route(SYSTEM_A, [0, 1], cache_salt="group-a") == (0, 4 * BLOCK)
    # Salted as the engine salts it: nothing of group b is cached anywhere.
    assert r.route(SYSTEM_A, [0, 1], cache_salt="group-b") == (1, 4 * BLOCK)
    assert r.route(SYSTEM_A, [0, 1], cache_salt="group-a") == (0, 0)


def test_affinity_gives_way_to_balance() -> None:
    r = router(max_imbalance=2)
    for _ in range(3):
        replica, uncached = r.route(SYSTEM_A, [0, 1])
        assert replica == 0
        r.prefilled(0, uncached)
    # Replica 0 holds the prefix but runs 3 requests to replica 1's none (over 2 more).
    assert r.route(SYSTEM_A, [0, 1]) == (1, 4 * BLOCK)


def test_affinity_gives_way_to_the_ttft_target() -> None:
    r = router()
    assert r.route(SYSTEM_A, [0, 1])[0] == 0
    # Replica 0 is predicted to miss the target: the prefix goes to replica 1 instead.
    missing = {0}
    chosen = r.route(SYSTEM_A, [0, 1], meets_target=lambda rid, n: rid not in missing)
    assert chosen == (1, 4 * BLOCK)
    # When none meets it, the best score wins all the same.
    chosen = r.route(SYSTEM_B, [0, 1], meets_target=lambda rid, n: False)
    assert chosen[0] in (0, 1)


def test_replica_reports_count_other_gateways_requests() -> None:
    r = router()
    r.report(0, 40)  # another gateway's requests fill replica 0
    assert r.route(SYSTEM_A, [0, 1])[0] == 1
    assert r.views[0].load == 40 and r.views[1].load == 1


def test_least_loaded_ignores_prefixes_and_round_robin_takes_turns() -> None:
    least = router("least_loaded")
    assert [least.route(SYSTEM_A, [0, 1])[0] for _ in range(4)] == [0, 1, 0, 1]
    for replica_id in (0, 1):
        least.finished(replica_id)
    turns = router("round_robin", replicas=3)
    assert [turns.route(SYSTEM_A, [0, 1, 2])[0] for _ in range(6)] == [1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="router policy"):
        RouterConfig(policy="random")


def _stats(**kwargs: object) -> SchedulerStats:
    base: dict[str, object] = {
        "num_running": 0,
        "num_waiting": 0,
        "num_kv_blocks_used": 0,
        "num_kv_blocks_total": 100,
        "num_prefix_query_tokens": 0,
        "num_prefix_hit_tokens": 0,
        "num_preemptions": 0,
        "num_steps": 0,
    }
    base.update(kwargs)
    return SchedulerStats(**base)  # type: ignore[arg-type]


def test_replica_ttft_is_priced_from_what_the_replica_reports() -> None:
    ttft = ReplicaTTFT.of(EngineConfig(scheduling_policy="fcfs"), ttft_target_s=1.0)
    # No step-time model yet (a replica just started): nothing known against it.
    assert ttft.predict(None, 1000) == 0.0
    assert ttft.predict(_stats(), 1000) == 0.0
    # 1 ms a step plus 0.1 ms a prefill token: a lone 1000-token prompt takes its steps
    # of max_num_batched_tokens each.
    model = {"intercept": 0.001, "prefill_tokens": 0.0001}
    alone = ttft.predict(_stats(step_time_coefficients=model), 1000)
    steps = math.ceil(1000 / ttft.max_num_batched_tokens)
    assert alone == pytest.approx(steps * 0.001 + 0.1)
    # The prompts the replica has not finished, and those sent since its report, go first.
    busy = _stats(step_time_coefficients=model, interactive_prefill_left=[4000])
    behind = ttft.predict(busy, 1000, sent=[2000])
    assert behind > alone
    assert behind == pytest.approx(ttft.predict(busy, 3000), rel=0.05)
    assert ttft.meets(alone) and not ttft.meets(ttft.predict(busy, 20_000))
