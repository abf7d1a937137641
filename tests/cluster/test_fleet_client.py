"""FleetClient, the gateway's side of the fleet, against replicas in this process: real
ReplicaBridges (the engine loop behind its bridge, over tcp on 127.0.0.1) with the fixed
runner, found through a directory the test controls instead of Ray. Routing, moving a
dead replica's requests with the tokens already received, fencing of old incarnations and
old attempts, the limit on moves, waiting for a replica to move to, and Ray's word that a
replica is dead."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
from support.local_fleet import (
    BOGUS,
    collect,
    fenced_outputs,
    fleet,
    request,
    until,
)

from tokenfleet.cluster.wire import ReplicaBeat
from tokenfleet.config import EngineConfig
from tokenfleet.core.request import PRIORITY_BATCH
from tokenfleet.engine.client import EngineDeadError

pytestmark = pytest.mark.fake("runner")


# -- routing ------------------------------------------------------------------------------


def test_requests_spread_over_the_ready_replicas_only(
    config: EngineConfig, fixed_token: int
) -> None:
    """Interactive requests with no prefix in common go by load, batch requests to the
    replica with the fewest of this gateway's batch requests: an even spread over the
    three ready replicas, none to the fourth, which Ray says is silent (still starting)."""

    async def run() -> None:
        async with fleet(config, 4, hidden={3: "silent"}) as f:
            streams = [await f.client.submit(request(f"i{n}", 30)) for n in range(6)]
            interactive = {i: len(link.requests) for i, link in f.client.links.items()}
            batch = [await f.client.submit(request(f"b{n}", 30, PRIORITY_BATCH)) for n in range(6)]
            num_batch = {i: link.num_batch for i, link in f.client.links.items()}
            assert interactive == {0: 2, 1: 2, 2: 2, 3: 0}
            assert num_batch == {0: 2, 1: 2, 2: 2, 3: 0}
            assert f.client.links[3].state == "starting"
            results = await asyncio.gather(*(collect(f, s) for s in streams + batch))
            assert results == [[fixed_token] * 30] * 12
            assert {i: len(link.requests) for i, link in f.client.links.items()} == dict.fromkeys(
                range(4), 0
            )
            assert f.client.num_moves == 0

    asyncio.run(run())


# -- failover -----------------------------------------------------------------------------


def test_a_silent_replicas_requests_move_and_end_with_exactly_max_tokens(
    config: EngineConfig, fixed_token: int
) -> None:
    """A replica stops beating mid-stream: after the replica timeout the gateway takes it
    for dead, and each of its requests goes on on the other replica from the tokens it
    had: no token repeated, none missing (the stream has exactly max_tokens)."""

    async def run() -> None:
        async with fleet(config, 2) as f:
            streams = [await f.client.submit(request(f"r{n}", 300)) for n in range(4)]
            tasks = [asyncio.create_task(collect(f, s)) for s in streams]
            await until(
                lambda: all(len(f.collected.get(s.req_id, [])) >= 10 for s in streams),
                "every stream has 10 tokens",
            )
            victim = f.link_of("r0")
            moved = {s.req_id for s in streams if f.link_of(s.req_id) == victim}
            assert len(moved) == 2
            f.stop(victim)
            results = await asyncio.gather(*tasks)
            assert results == [[fixed_token] * 300] * 4
            assert f.client.links[victim].state == "dead"
            assert f.client.num_moves == len(moved)
            # Still listed with the incarnation declared dead (frozen, as Ray would not
            # notice): the gateway asks for it to be replaced, once.
            await until(lambda: f.directory.restarts == [victim], "a replacement asked for")
            await asyncio.sleep(3 * f.client.discover_interval_s)
            assert f.directory.restarts == [victim]

    asyncio.run(run())


def test_outputs_of_a_fenced_incarnation_are_dropped(
    config: EngineConfig, fixed_token: int
) -> None:
    """A message from an incarnation the gateway no longer talks to (an older copy of
    the replica that Ray restarted elsewhere) is dropped: its token is not passed on, it
    does not end the request, and it does not count as the replica speaking."""

    async def run() -> None:
        async with fleet(config, 1) as f:
            stream = await f.client.submit(request("r", 200))
            task = asyncio.create_task(collect(f, stream))
            await until(lambda: len(f.collected.get("r", [])) >= 5, "5 tokens")
            link = f.client.links[0]
            assert link.incarnation is not None
            old = link.incarnation - 1
            engine_id = f.moving("r").engine_id
            assert engine_id == "r/0"
            heard = link.last_heard
            f.client._received(ReplicaBeat(0, old, None, None, None, 0.0, 0))
            f.client._received(fenced_outputs(0, old, engine_id))
            assert link.last_heard == heard and link.info is not None
            assert BOGUS not in f.moving("r").received
            assert "r" in f.client._requests  # not ended
            assert await task == [fixed_token] * 200

    asyncio.run(run())


def test_outputs_of_an_older_attempt_are_dropped(config: EngineConfig, fixed_token: int) -> None:
    """Once a request moved (attempt 1), an output for its attempt 0, even from the
    replica it now runs on, is dropped; the request ends with exactly max_tokens."""

    async def run() -> None:
        async with fleet(config, 2) as f:
            stream = await f.client.submit(request("r", 300))
            task = asyncio.create_task(collect(f, stream))
            await until(lambda: len(f.collected.get("r", [])) >= 10, "10 tokens")
            first = f.link_of("r")
            f.stop(first)
            await until(
                lambda: f.moving("r").attempt == 1 and f.link_of("r") == 1 - first,
                "the request moved to the other replica",
            )
            link = f.client.links[1 - first]
            assert f.moving("r").engine_id == "r/1"
            assert link.incarnation is not None
            f.client._received(fenced_outputs(link.replica_id, link.incarnation, "r/0"))
            assert BOGUS not in f.moving("r").received
            assert "r" in f.client._requests
            assert await task == [fixed_token] * 300

    asyncio.run(run())


def test_a_request_moved_more_than_max_moves_ends_with_engine_dead_error(
    config: EngineConfig, fixed_token: int
) -> None:
    """max_moves=1: the request survives its first replica's death, and its second
    replica's death ends it with EngineDeadError (the tokens before it stay delivered)."""

    async def run() -> None:
        async with fleet(config, 2, max_moves=1) as f:
            stream = await f.client.submit(request("r", 1000))
            task = asyncio.create_task(collect(f, stream))
            await until(lambda: len(f.collected.get("r", [])) >= 10, "10 tokens")
            first = f.link_of("r")
            f.stop(first)
            await until(lambda: f.moving("r").attempt == 1, "the first move")
            count = len(f.collected["r"])
            await until(lambda: len(f.collected["r"]) >= count + 10, "10 tokens after the move")
            f.stop(1 - first)
            with pytest.raises(EngineDeadError, match="moved 1 times"):
                await task
            assert set(f.collected["r"]) == {fixed_token}
            assert len(f.collected["r"]) < 1000
            assert f.client._requests == {} and f.client.num_moves == 1

    asyncio.run(run())


def test_a_moved_request_waits_for_a_ready_replica_and_goes_to_it(
    config: EngineConfig, fixed_token: int
) -> None:
    """Its replica dead and none other ready, a request is parked (not failed); when a
    replica becomes ready, it is placed there and ends with exactly max_tokens."""

    async def run() -> None:
        async with fleet(config, 2, hidden={1: "silent"}) as f:
            stream = await f.client.submit(request("r", 300))
            task = asyncio.create_task(collect(f, stream))
            await until(lambda: len(f.collected.get("r", [])) >= 10, "10 tokens")
            assert f.link_of("r") == 0
            f.stop(0)
            await until(lambda: f.moving("r").parked_at is not None, "the request parked")
            parked = len(f.collected["r"])
            await asyncio.sleep(0.3)  # several watchdog rounds: it stays parked
            assert f.moving("r").parked_at is not None and f.link_of("r") == -1
            assert not task.done() and len(f.collected["r"]) == parked
            f.directory.entries[1] = f.bridges[1]  # the replica comes up
            assert await task == [fixed_token] * 300
            assert f.client.links[1].state == "ready" and f.client.num_moves == 1

    asyncio.run(run())


@pytest.mark.parametrize("ray_says", ["dead", "restarting"])
def test_a_replica_ray_reports_down_is_dead_to_the_gateway_at_once(
    config: EngineConfig, fixed_token: int, ray_says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Ray's word is enough: the replica is dead to the gateway at the next look (not
    after a silence: the replica still beats, and the timeout is long), its requests move,
    and what the old incarnation still sends (it never got an abort: the link is closed)
    is dropped: the stream has exactly max_tokens."""

    async def run() -> None:
        async with fleet(config, 2, replica_timeout_s=600.0) as f:
            stream = await f.client.submit(request("r", 300))
            task = asyncio.create_task(collect(f, stream))
            await until(lambda: len(f.collected.get("r", [])) >= 10, "10 tokens")
            victim = f.link_of("r")
            with caplog.at_level(logging.ERROR, logger="tokenfleet.cluster.client"):
                f.directory.entries[victim] = ray_says
                await until(lambda: f.client.links[victim].state == "dead", "the replica dead")
            assert f"Ray reports it {ray_says}" in caplog.text
            assert await task == [fixed_token] * 300
            assert f.client.num_moves == 1

    asyncio.run(run())


def test_what_a_replica_reports_replaces_what_the_gateway_counted_itself(
    config: EngineConfig, fixed_token: int
) -> None:
    """Prompts the gateway sent count as ahead in a replica's queue only until the
    replica's reports include them: after more requests than the replica has sequence
    slots, one after another, admission still admits and the router still sees an idle
    replica (a gateway that never forgot them would refuse everything from then on)."""

    async def run() -> None:
        async with fleet(config, 1) as f:
            for n in range(config.scheduler.max_num_seqs + 8):
                stream = await f.client.submit(request(f"r{n}", 2))
                assert await collect(f, stream) == [fixed_token] * 2
            link = f.client.links[0]
            await until(lambda: not link.ahead, "every prompt sent counted in a report")
            assert link.num_reports > 2
            verdict = f.client.predict_ttft(100)
            assert verdict is not None and verdict.admitted
            assert f.client.router.views[0].load == 0

    asyncio.run(run())


def test_sixteen_replicas_keep_each_shared_prefix_on_one_and_spread_the_prefixes(
    config: EngineConfig, fixed_token: int
) -> None:
    """The router at a fleet's scale, through FleetClient: 16 replicas, 6 system prompts
    of 8 blocks, 5 users each (a distinct suffix), in rounds of concurrent requests. Every
    request of a prompt after its first goes to the replica that has it (its prefix cache:
    the replicas' own hit counts say so), and the 6 prompts land on 6 different replicas."""
    block = config.cache.block_size
    prompts = [[1000 * (p + 1) + t for t in range(8 * block)] for p in range(6)]

    async def run() -> None:
        async with fleet(config, 16) as f:
            placed: dict[int, set[int]] = {p: set() for p in range(len(prompts))}
            for user in range(5):
                streams = []
                for p, system in enumerate(prompts):
                    req = request(f"p{p}-u{user}", 4)
                    req.prompt_token_ids = [*system, 7, user, p]
                    streams.append((p, await f.client.submit(req)))
                for p, stream in streams:
                    placed[p].add(f.link_of(stream.req_id))
                results = await asyncio.gather(*(collect(f, s) for _, s in streams))
                assert results == [[fixed_token] * 4] * len(prompts)
            assert all(len(replicas) == 1 for replicas in placed.values()), placed
            holders = {next(iter(r)) for r in placed.values()}
            assert len(holders) == len(prompts)
            # Each prompt's later 4 requests hit its 8 blocks on the replica that holds it.
            await until(
                lambda: all(
                    f.client.links[r].stats is not None
                    and f.client.links[r].stats.num_prefix_hit_tokens == 4 * 8 * block
                    for r in holders
                ),
                "every holder's hits reported",
            )

    asyncio.run(run())


def test_a_step_of_seconds_is_not_taken_for_a_death(config: EngineConfig, fixed_token: int) -> None:
    """Each step takes 2 s, longer than the 1.5 s replica timeout: the bridge beats from
    its own thread meanwhile, so the replica stays ready and nothing moves."""
    slow = dataclasses.replace(config, fixed_step_s=2.0)

    async def run() -> None:
        async with fleet(slow, 1, replica_timeout_s=1.5) as f:
            stream = await f.client.submit(request("slow", 3))
            assert await collect(f, stream) == [fixed_token] * 3
            assert f.client.links[0].state == "ready"
            assert f.client.num_moves == 0

    asyncio.run(run())
