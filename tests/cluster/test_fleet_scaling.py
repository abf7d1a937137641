"""Scaling and draining (cluster/scaling.py) through FleetClient, against replicas in this
process: real ReplicaBridges with the fixed runner, and a stand-in for Ray's directory
(support/local_fleet.py) that starts, flags and stops bridges when the scaler asks. The
real Ray path is tests/cluster/test_fleet_scale_fixed_runner.py.

What a drain promises: a draining replica gets no new work, its requests end on it within
the grace period, the rest move (exact token counts, not counted as moves for
`max_moves`), whatever it sends of a moved request's old attempt is dropped, and only
then it is stopped."""

from __future__ import annotations

import asyncio

import pytest
from support.local_fleet import (
    BOGUS,
    Fleet,
    collect,
    fenced_outputs,
    fleet,
    request,
    until,
)

from tokenfleet.config import EngineConfig
from tokenfleet.errors import InvalidRequestError

pytestmark = [pytest.mark.fake("runner"), pytest.mark.fake("directory")]

GRACE_S = 0.5
SHORT = 20  # tokens: ends well within the grace (20 steps of 5 ms)
LONG = 1000  # tokens: runs past the grace (1000 steps of 5 ms at least)


def states(f: Fleet) -> dict[int, str]:
    return {i: link.state for i, link in sorted(f.client.links.items())}


def test_scale_up_with_a_stand_in_directory_adds_replicas_routable_once_ready(
    config: EngineConfig, fixed_token: int
) -> None:
    """1 -> 3: ids 1 and 2 are started, shown `starting` at once (no second scale-up
    takes their ids), then `ready`; requests then spread over all three."""

    async def run() -> None:
        async with fleet(config, 1) as f:
            plan = f.client.scale(3)
            assert plan == {"replicas": 3, "added": [1, 2], "kept": [], "draining": []}
            assert states(f) == {0: "ready", 1: "starting", 2: "starting"}
            assert f.client.scale(3)["added"] == []  # already aimed at: nothing more
            await until(lambda: states(f) == dict.fromkeys(range(3), "ready"), "3 ready")
            assert f.directory.calls == [("add", 1), ("add", 2)]
            streams = [await f.client.submit(request(f"r{n}", 30)) for n in range(6)]
            assert sorted(len(link.requests) for link in f.client.links.values()) == [2, 2, 2]
            results = await asyncio.gather(*(collect(f, s) for s in streams))
            assert results == [[fixed_token] * 30] * 6

    asyncio.run(run())


def test_a_drain_with_a_stand_in_directory_finishes_short_requests_moves_long_ones_then_stops(
    config: EngineConfig, fixed_token: int
) -> None:
    """2 -> 1 while replica 1 runs 2 short and 2 long requests: it is flagged draining and
    gets none of the 6 requests sent next; the short ones end on it; after the grace the
    long ones move to replica 0 with the tokens they had (exactly max_tokens each, no move
    counted against max_moves=0); an output of a moved request's old attempt from it is
    dropped; then it is stopped and gone from the links, its drain on record."""

    async def run() -> None:
        async with fleet(config, 2, max_moves=0, drain_grace_s=GRACE_S) as f:
            first = [await f.client.submit(request(f"a{n}", SHORT)) for n in range(2)]
            first += [await f.client.submit(request(f"b{n}", LONG)) for n in range(2)]
            short = [s.req_id for s in first[:2] if f.link_of(s.req_id) == 1]
            long = [s.req_id for s in first[2:] if f.link_of(s.req_id) == 1]
            assert len(short) == len(long) == 1  # one of each on replica 1
            tasks = [asyncio.create_task(collect(f, s)) for s in first]
            await until(lambda: len(f.collected.get(long[0], [])) >= 5, "5 tokens")
            incarnation = f.client.links[1].incarnation
            assert incarnation is not None
            plan = f.client.scale(1)
            assert plan == {"replicas": 1, "added": [], "kept": [], "draining": [1]}
            assert states(f) == {0: "ready", 1: "draining"}
            later = [await f.client.submit(request(f"c{n}", SHORT)) for n in range(6)]
            assert {f.link_of(s.req_id) for s in later} == {0}
            tasks += [asyncio.create_task(collect(f, s)) for s in later]
            await until(lambda: f.bridges[1].draining, "the replica flagged draining")
            await until(lambda: f.moving(long[0]).attempt == 1, "the long request moved")
            assert f.link_of(long[0]) == 0 and f.moving(long[0]).num_drain_moves == 1
            assert short[0] not in f.client._requests  # it ended on replica 1
            # Still linked (it stops two reports after the move at the earliest): what it
            # sends of attempt 0 now is dropped.
            assert f.client.links[1].incarnation == incarnation
            f.client._received(fenced_outputs(1, incarnation, f"{long[0]}/0"))
            assert BOGUS not in f.moving(long[0]).received
            results = await asyncio.gather(*tasks)
            assert (
                results
                == [[fixed_token] * SHORT] * 2
                + [[fixed_token] * LONG] * 2
                + [[fixed_token] * SHORT] * 6
            )
            await until(lambda: 1 not in f.client.links, "replica 1 gone")
            await until(lambda: ("remove", 1) in f.directory.calls, "replica 1 stopped")
            assert f.directory.calls == [("set_draining", 1, True), ("remove", 1)]
            assert 1 not in f.directory.entries and states(f) == {0: "ready"}
            assert f.client.num_moves == 0 and f.client.scaler.num_drain_moves == 1
            (drain,) = f.client.scaler.ended
            assert (drain.replica_id, drain.outcome, drain.num_moved) == (1, "stopped", 1)
            assert drain.seconds(0) >= GRACE_S
            await asyncio.sleep(5 * f.client.discover_interval_s)
            assert 1 not in f.client.links  # an answer in flight did not bring it back

    asyncio.run(run())


def test_scaling_up_again_with_a_stand_in_directory_cancels_a_drain_in_progress(
    config: EngineConfig, fixed_token: int
) -> None:
    """3 -> 2 -> 3 within the grace: replica 2 drains, then is ready again (its flag
    cleared, no new replica started), and its long request ends on it unmoved."""

    async def run() -> None:
        async with fleet(config, 3, drain_grace_s=30.0) as f:
            streams = [await f.client.submit(request(f"r{n}", 300)) for n in range(3)]
            on_two = next(s.req_id for s in streams if f.link_of(s.req_id) == 2)
            tasks = [asyncio.create_task(collect(f, s)) for s in streams]
            assert f.client.scale(2)["draining"] == [2]
            assert f.client.scale(3) == {"replicas": 3, "added": [], "kept": [2], "draining": []}
            assert states(f) == dict.fromkeys(range(3), "ready")
            await until(lambda: len(f.directory.calls) == 2, "both flag calls made")
            assert sorted(f.directory.calls) == [
                ("set_draining", 2, False),
                ("set_draining", 2, True),
            ]
            assert await asyncio.gather(*tasks) == [[fixed_token] * 300] * 3
            assert on_two not in f.client._requests and f.client.scaler.num_drain_moves == 0
            assert ("remove", 2) not in f.directory.calls and 2 in f.directory.entries
            assert [d.outcome for d in f.client.scaler.ended] == ["cancelled"]

    asyncio.run(run())


def test_a_drain_another_gateway_asked_for_is_followed_with_a_stand_in_directory(
    config: EngineConfig, fixed_token: int
) -> None:
    """Replica 1 flagged draining by another gateway (the directory shows the flag): this
    gateway sends it nothing new, moves its own request after the grace, and does not stop
    it; when Ray then reports it dead, it is gone here too (not listed `dead`)."""

    async def run() -> None:
        async with fleet(config, 2, drain_grace_s=GRACE_S) as f:
            streams = [await f.client.submit(request(f"r{n}", LONG)) for n in range(2)]
            on_one = next(s.req_id for s in streams if f.link_of(s.req_id) == 1)
            tasks = [asyncio.create_task(collect(f, s)) for s in streams]
            f.bridges[1].draining = True
            await until(lambda: states(f)[1] == "draining", "the flag followed")
            later = await f.client.submit(request("later", SHORT))
            assert f.link_of("later") == 0
            await until(lambda: f.link_of(on_one) == 0, "its request moved")
            await asyncio.sleep(0.3)
            assert 1 in f.client.links and f.directory.calls == []  # not ours to stop
            f.directory.entries[1] = "dead"
            await until(lambda: 1 not in f.client.links, "gone")
            results = await asyncio.gather(*tasks, collect(f, later))
            assert results == [[fixed_token] * LONG] * 2 + [[fixed_token] * SHORT]
            await asyncio.sleep(5 * f.client.discover_interval_s)
            assert 1 not in f.client.links
            assert [(d.replica_id, d.outcome) for d in f.client.scaler.ended] == [(1, "died")]

    asyncio.run(run())


def test_a_replica_ray_brings_back_counts_in_the_size_and_goes_first_on_a_scale_down(
    config: EngineConfig,
) -> None:
    """Replica 1 reported `restarting` (Ray brings it back): it is dead here but counts,
    so scale(2) adds nothing; scale(1) stops it at once (no drain: its requests moved when
    it went down) and keeps the ready one."""

    async def run() -> None:
        async with fleet(config, 2) as f:
            f.directory.entries[1] = "restarting"
            await until(lambda: states(f)[1] == "dead", "replica 1 dead here")
            assert f.client.scaler.size() == 2
            assert f.client.scale(2) == {"replicas": 2, "added": [], "kept": [], "draining": []}
            assert f.client.scale(1)["draining"] == [1]
            assert states(f) == {0: "ready"}
            await until(lambda: ("remove", 1) in f.directory.calls, "replica 1 stopped")
            assert f.directory.calls == [("remove", 1)]
            assert [(d.replica_id, d.outcome) for d in f.client.scaler.ended] == [(1, "down")]
            assert f.client.scaler.size() == 1

    asyncio.run(run())


def test_a_replica_ray_gave_up_on_is_not_counted_and_a_scale_to_the_same_size_replaces_it(
    config: EngineConfig, fixed_token: int
) -> None:
    """Replica 1 reported `dead` (Ray's restarts used up): not counted, shown given up;
    scale(2) starts replica 2 in its place, and requests run on 0 and 2."""

    async def run() -> None:
        async with fleet(config, 2) as f:
            f.directory.entries[1] = "dead"
            await until(lambda: states(f)[1] == "dead", "replica 1 dead here")
            assert f.client.links[1].given_up and f.client.scaler.size() == 1
            assert f.client.describe()[1]["given_up"] is True
            assert f.client.scale(2)["added"] == [2]
            await until(lambda: states(f) == {0: "ready", 1: "dead", 2: "ready"}, "2 ready")
            assert f.client.scaler.size() == 2
            streams = [await f.client.submit(request(f"r{n}", 10)) for n in range(4)]
            assert sorted(f.link_of(s.req_id) for s in streams) == [0, 0, 2, 2]
            results = await asyncio.gather(*(collect(f, s) for s in streams))
            assert results == [[fixed_token] * 10] * 4

    asyncio.run(run())


def test_a_size_outside_1_to_the_maximum_is_refused(config: EngineConfig) -> None:
    async def run() -> None:
        async with fleet(config, 1) as f:
            for bad in (0, -1, 10_000, True):
                with pytest.raises(InvalidRequestError, match="replicas: must be an integer"):
                    f.client.scale(bad)
            assert f.client.scaler.target is None and states(f) == {0: "ready"}

    asyncio.run(run())
