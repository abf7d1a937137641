"""How much batch work a replica leases at a time: one rule for the gateway's dispatcher and
the simulator."""

from __future__ import annotations


def lease_room(
    in_flight: int, engine_load: tuple[int, int] | None, queue_target: int, depth: int
) -> int:
    """How many more batch requests to lease now: enough to keep about `queue_target` of
    them waiting in the engine beyond those it runs (so it never starves between two looks),
    and no more, so that a cancel or an interactive burst finds little to undo. Before the
    engine has reported its load, `queue_target` in all; never over `depth` in flight."""
    running = engine_load[0] if engine_load is not None else 0
    return max(0, min(depth, running + queue_target) - in_flight)
