"""Account for gRPC calls that end before Sluice's handler runs.

grpc.aio runs each call in a task of its own: it looks the handler up (our generic handler's
`service()`), then, for a unary method, waits for the request message before calling the
handler. A client that cancels in between (a connection storm, a client that gives up at once)
ends the call inside grpc: the handler never runs, so neither the access log nor the request
metrics would see it. The lookup runs inside that task, so `looked_up()` registers the task and
a done-callback; the handler's first step calls `started()`; a task that ends still registered
is counted in `sluice_grpc_calls_ended_before_handler_total` and summed in one log line per
`LOG_EVERY_S`. A call cancelled before grpc even looks its handler up is not seen (grpc's
channelz, which would count it, is off: it costs on every call).
"""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.telemetry import metrics

log = logging.getLogger("sluice.grpc")

LOG_EVERY_S = 10.0


class CallAccounting:
    """Calls between handler lookup and handler start, per listener. Bounded by the calls grpc
    runs at once (max concurrent streams x connections): each entry leaves when its task ends."""

    __slots__ = ("_pending", "_unlogged", "_logged_at", "_cancelled", "_ended")

    def __init__(self) -> None:
        self._pending: set[asyncio.Task[object]] = set()
        self._unlogged = 0
        self._logged_at = time.monotonic() - LOG_EVERY_S  # the first one is logged at once
        self._cancelled = metrics.GRPC_ENDED_BEFORE_HANDLER.labels("cancelled")
        self._ended = metrics.GRPC_ENDED_BEFORE_HANDLER.labels("no_request")

    def looked_up(self) -> None:
        """From the generic handler's lookup, in the call's own task."""
        task = asyncio.current_task()
        if task is not None and task not in self._pending:
            self._pending.add(task)
            task.add_done_callback(self._done)

    def started(self) -> None:
        """From the handler's first step: the call is the handler's to account for now."""
        task = asyncio.current_task()
        if task is not None:
            self._pending.discard(task)

    def _done(self, task: asyncio.Task[object]) -> None:
        if task not in self._pending:
            return
        self._pending.discard(task)
        (self._cancelled if task.cancelled() else self._ended).inc()
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning(
                "%d gRPC calls ended before reaching the handler in the last %.0f s "
                "(client cancelled, or sent no request message)",
                self._unlogged,
                now - self._logged_at,
            )
            self._unlogged, self._logged_at = 0, now

    @property
    def pending(self) -> int:
        return len(self._pending)
