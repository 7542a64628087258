"""(compiled) The count of requests in flight: the gateway owns one (`Gateway.inflight`), every
request enters and leaves it (`gateway.forward.lifecycle`), and the drain waits for it to reach
zero. Compiled with the request path: entering and leaving are two calls a request."""

from __future__ import annotations

import asyncio


class InFlight:
    """Counts requests being served; the drain waits for zero."""

    __slots__ = ("count", "_idle")

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        if not self.count:  # the first in flight (an Event.clear is a Python call)
            self._idle.clear()
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if self.count <= 0:
            self.count = 0
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
