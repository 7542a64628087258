"""(compiled) Deadlines of the requests in flight (total, body read, client stall), one coarse
ticker.

`asyncio.timeout` costs ~4.6 µs per request here (a `call_at` alone ~2.9 µs); these deadlines
are seconds to minutes, so a `TICK_S` ticker that runs only while requests are in flight, and
cancels the overdue ones, is as good and costs a dict write per change. A cancelled task asks
`expired(task)` which deadline it was (`TOTAL`, `BODY`, `STALL`, `FIRST_BYTE`, `IDLE`), or
None: the client left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

TOTAL, BODY, STALL = "total", "body", "stall"
FIRST_BYTE, IDLE = "first_byte", "idle"  # gRPC: the upstream call's first message, silence


class Deadlines:
    TICK_S = 0.05

    __slots__ = ("_due", "_total", "_fired", "_timer", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: dict[asyncio.Task[Any], tuple[float, str, Callable[[], Any] | None]] = {}
        self._total: dict[asyncio.Task[Any], float] = {}
        self._fired: dict[asyncio.Task[Any], str] = {}
        self._timer: asyncio.TimerHandle | None = None

    def start(self, task: asyncio.Task[Any], total_s: float) -> None:
        deadline = self._loop.time() + total_s
        self._total[task] = deadline
        self._due[task] = (deadline, TOTAL, None)
        if self._timer is None:
            self._timer = self._loop.call_later(self.TICK_S, self._tick)

    def tighten(
        self,
        task: asyncio.Task[Any],
        seconds: float,
        kind: str,
        action: Callable[[], Any] | None = None,
    ) -> None:
        """Until `relax`, the task must make progress within `seconds` (or its total). When it
        expires the task is cancelled, or `action()` runs instead (the task is left alone)."""
        total = self._total.get(task)
        if total is None:
            return
        deadline = self._loop.time() + seconds
        self._due[task] = (deadline, kind, action) if deadline < total else (total, TOTAL, None)

    def relax(self, task: asyncio.Task[Any]) -> None:
        total = self._total.get(task)
        if total is not None:
            self._due[task] = (total, TOTAL, None)

    def stop(self, task: asyncio.Task[Any]) -> None:
        self._due.pop(task, None)
        self._total.pop(task, None)
        self._fired.pop(task, None)

    def expired(self, task: asyncio.Task[Any]) -> str | None:
        """Which deadline cancelled `task` (and forget it), or None."""
        kind = self._fired.pop(task, None)
        if kind is not None:
            self._due.pop(task, None)
            self._total.pop(task, None)
        return kind

    def _tick(self) -> None:
        self._timer = None
        now = self._loop.time()
        overdue = [(t, k, a) for t, (d, k, a) in self._due.items() if d <= now]
        for task, kind, action in overdue:
            del self._due[task]
            self._fired[task] = kind
            if action is None:
                task.cancel()
            else:
                action()
        if self._due:
            self._timer = self._loop.call_later(self.TICK_S, self._tick)
