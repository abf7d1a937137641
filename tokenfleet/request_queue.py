"""The waiting queue: the seam where a scheduling policy decides who is admitted next.

First come, first served for now; preempted requests go back to the front so that they
resume before newer arrivals. Priority classes replace this class, not the scheduler.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from tokenfleet.request import Request


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
