"""The waiting queue: who is admitted next.

One first-come-first-served queue per priority class; the most urgent non-empty class
(lowest `Request.priority`) is served first. A preempted request goes back to the front
of its own class's queue, so it resumes before the later arrivals of its class but
never jumps ahead of a more urgent class:

    class 0 (interactive):  [i4] [i5]
    class 1 (batch):        [b2*] [b7] [b8]      * preempted, prepended to its class

    pop order: i4, i5, b2, b7, b8
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from tokenfleet.core.request import Request


class PriorityRequestQueue:
    def __init__(self) -> None:
        self._classes: dict[int, deque[Request]] = {}

    def add(self, request: Request) -> None:
        self._class(request.priority).append(request)

    def prepend(self, request: Request) -> None:
        self._class(request.priority).appendleft(request)

    def peek(self) -> Request:
        return self._most_urgent()[0]

    def pop(self) -> Request:
        queue = self._most_urgent()
        request = queue.popleft()
        if not queue:
            del self._classes[request.priority]
        return request

    def remove(self, request: Request) -> None:
        queue = self._classes[request.priority]
        queue.remove(request)
        if not queue:
            del self._classes[request.priority]

    @property
    def priorities(self) -> list[int]:
        """The classes with a request waiting, most urgent first."""
        return sorted(self._classes)

    def num_waiting(self, priority: int) -> int:
        return len(self._classes.get(priority, ()))

    def _class(self, priority: int) -> deque[Request]:
        return self._classes.setdefault(priority, deque())

    def _most_urgent(self) -> deque[Request]:
        if not self._classes:
            raise IndexError("the waiting queue is empty")
        return self._classes[min(self._classes)]

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._classes.values())

    def __bool__(self) -> bool:
        return bool(self._classes)

    def __iter__(self) -> Iterator[Request]:
        """In pop order."""
        for priority in self.priorities:
            yield from self._classes[priority]
