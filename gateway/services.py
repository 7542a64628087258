"""Long-lived state of the gateway: built once at start, closed once at stop, outliving reloads.

A policy reload builds new filters over the same services: a rate-limit bucket, a breaker, a
JWKS cache, the health of a backend member or the sampler's buffer stays where it was. Each
feature keeps its state in one owner object that it gets with `services.get(key, factory)`: the
first call creates it, every later call (the next policy's filters) finds the same object.
`aclose()` closes every owner that has an `aclose` (or `close`) method, in reverse order of
creation, and cancels the background tasks started with `spawn`.

What happens to a piece of state when its policy section changes is the owner's rule, stated in
its docstring (kept when its parameters did not change; re-sized or reset when they did).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from gateway.core.clock import Clock, MonotonicClock

log = logging.getLogger("sluice.services")

T = TypeVar("T")


class Services:
    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self._owners: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False
        # Sheds a source address in the kernel for ttl seconds (None: the datapath's default);
        # False when the datapath is not running. Set by the server, which owns the datapath.
        self.deny: Callable[[str, float | None], bool] | None = None

    def get(self, key: str, factory: Callable[[], T]) -> T:
        """The one owner of `key`, created by `factory()` on first use."""
        owner = self._owners.get(key)
        if owner is None:
            owner = self._owners[key] = factory()
        return owner

    def peek(self, key: str) -> Any:
        """The owner of `key` if it exists (for /readyz, /admin/state), else None."""
        return self._owners.get(key)

    def readiness(self) -> dict[str, Any]:
        """`/readyz` detail: each owner with a `readiness()` method, under its key (e.g. JWKS
        age and last error, the limit store's mode). Informational: never makes the gateway
        unready by itself."""
        return {k: o.readiness() for k, o in self._owners.items() if hasattr(o, "readiness")}

    def state(self) -> dict[str, Any]:
        """`/admin/state`: each owner with a `state()` method (JSON-able), under its key."""
        return {k: o.state() for k, o in self._owners.items() if hasattr(o, "state")}

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str = "") -> asyncio.Task[Any]:
        """Run a background task owned by the services (cancelled at `aclose`). Needs a
        running loop; a task that fails is logged, never silently lost."""
        task = asyncio.get_running_loop().create_task(coro, name=name or None)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def aclose(self) -> None:
        self.closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for key, owner in reversed(list(self._owners.items())):
            close = getattr(owner, "aclose", None) or getattr(owner, "close", None)
            if close is None:
                continue
            try:
                result = close()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("closing %s failed", key)
