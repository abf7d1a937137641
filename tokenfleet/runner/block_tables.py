"""The runner's copy of each request's block table, kept from step to step as rows of one
array: the scheduler sends only what changed (a request's new block ids, its whole table
when it is new to the runner or resumed), as vLLM v1's runner keeps its own.

The tables follow the SchedulerOutputs in the order they were planned (ModelRunner.prepare,
which with the overlap runs a step ahead of the forward): a step's finished and preempted
requests are dropped, then each scheduled request's table is started afresh
(`new_table`) or extended by its `new_block_ids`. A step's attention reads its decodes'
rows through a gather, a copy, so the next step's changes never reach a forward still
running. Torch-free: the model runner and the test suite's reading runner share it.
"""

from __future__ import annotations

import numpy as np

from tokenfleet.core.scheduler_output import SchedulerOutput


class BlockTables:
    """Block ids by request: row `row_of[req_id]` of `ids`, its first `num_blocks[row]`
    entries; zeros after them."""

    def __init__(self, max_blocks_per_seq: int, num_rows: int = 64) -> None:
        self.ids = np.zeros((num_rows, max_blocks_per_seq), np.int64)
        self.num_blocks = np.zeros(num_rows, np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def update(self, so: SchedulerOutput) -> list[int]:
        """Apply one step's changes; the rows of its scheduled requests, in order."""
        for req_id in so.finished_req_ids:
            self._drop(req_id)
        for req_id in so.preempted_req_ids:
            self._drop(req_id)
        rows = []
        row_of = self.row_of
        for s in so.scheduled:
            row = row_of.get(s.req_id)
            if row is None:
                row = self._take(s.req_id)
            elif s.new_table:
                self._clear(row)
            if s.new_block_ids:
                start = int(self.num_blocks[row])
                end = start + len(s.new_block_ids)
                if end > self.ids.shape[1]:
                    self._widen(end)
                self.ids[row, start:end] = s.new_block_ids
                self.num_blocks[row] = end
            rows.append(row)
        return rows

    def block_ids(self, req_id: str) -> list[int]:
        """A request's table, as a list (the whole of it)."""
        row = self.row_of[req_id]
        return self.ids[row, : self.num_blocks[row]].tolist()

    def row(self, req_id: str) -> np.ndarray:
        """A request's table, as a view of its row."""
        row = self.row_of[req_id]
        return self.ids[row, : self.num_blocks[row]]

    def __len__(self) -> int:
        return len(self.row_of)

    def _take(self, req_id: str) -> int:
        if not self._free_rows:  # twice the rows, the old ones kept where they are
            num_rows = len(self.num_blocks)
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        return row

    def _widen(self, num_blocks: int) -> None:
        """Room for `num_blocks` a row (at least twice the width: a table longer than the
        runner was told to expect, in tests that never say)."""
        width = max(num_blocks, 2 * self.ids.shape[1])
        wider = np.zeros((len(self.ids), width), np.int64)
        wider[:, : self.ids.shape[1]] = self.ids
        self.ids = wider

    def _drop(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._clear(row)
            self._free_rows.append(row)

    def _clear(self, row: int) -> None:
        self.ids[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
