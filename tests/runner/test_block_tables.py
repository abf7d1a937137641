"""The runner's block tables, kept from what each step changed (runner/block_tables.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenfleet.runner.block_tables import BlockTables


def _row(req_id: str, new_block_ids: list[int], new_table: bool) -> ScheduledRequest:
    return ScheduledRequest(req_id, [1], 0, new_block_ids, new_table, True, SamplingParams())


def _step(
    *rows: ScheduledRequest, finished: tuple[str, ...] = (), preempted: tuple[str, ...] = ()
) -> SchedulerOutput:
    return SchedulerOutput(list(rows), frozenset(finished), preempted)


def test_new_block_ids_extend_a_table_and_a_new_table_starts_it_afresh() -> None:
    tables = BlockTables(max_blocks_per_seq=4)
    assert tables.update(_step(_row("a", [3, 1], True), _row("b", [2], True))) == [0, 1]
    assert tables.update(_step(_row("b", [], False), _row("a", [7], False))) == [1, 0]
    assert (tables.block_ids("a"), tables.block_ids("b")) == ([3, 1, 7], [2])
    tables.update(_step(_row("a", [5], True)))  # resumed: its table whole again
    assert tables.block_ids("a") == [5]
    assert tables.ids[0].tolist() == [5, 0, 0, 0]  # zeros past a row's blocks


def test_finished_and_preempted_requests_give_their_rows_back_zeroed() -> None:
    tables = BlockTables(max_blocks_per_seq=2, num_rows=2)
    tables.update(_step(_row("a", [4, 5], True), _row("b", [6], True)))
    tables.update(_step(finished=("a",), preempted=("b", "never-seen")))
    assert len(tables) == 0
    assert tables.ids.tolist() == [[0, 0], [0, 0]]
    # A reused id (ended, then added again): dropped first, then started afresh.
    tables.update(_step(_row("a", [1], True)))
    tables.update(_step(_row("a", [2], True), finished=("a",)))
    assert tables.block_ids("a") == [2]


def test_rows_and_width_grow_past_what_was_asked_for() -> None:
    tables = BlockTables(max_blocks_per_seq=1, num_rows=1)
    tables.update(_step(_row("a", [1], True), _row("b", [2, 3, 4], True)))
    tables.update(_step(_row("c", [9], True), _row("a", [5, 6], False)))
    assert [tables.block_ids(r) for r in "abc"] == [[1, 5, 6], [2, 3, 4], [9]]
    assert tables.row("b").tolist() == [2, 3, 4]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans()), max_size=60))
def test_tables_equal_the_whole_lists_they_follow(changes: list[tuple[int, int, bool]]) -> None:
    """Random appends, restarts and ends, one request a step: the tables always equal the
    lists the changes describe."""
    tables = BlockTables(max_blocks_per_seq=2, num_rows=2)
    whole: dict[str, list[int]] = {}
    next_id = 0
    for request, num_new, ends in changes:
        req_id = f"r{request}"
        new_table = req_id not in whole
        ids = list(range(next_id, next_id + num_new + (1 if new_table else 0)))
        next_id += len(ids)
        whole[req_id] = ids if new_table else whole[req_id] + ids
        tables.update(_step(_row(req_id, ids, new_table)))
        if ends:
            tables.update(_step(finished=(req_id,)))
            del whole[req_id]
        assert {r: tables.block_ids(r) for r in whole} == whole
        assert len(tables) == len(whole)
