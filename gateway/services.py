"""Long-lived state of the gateway: built once at start, closed once at stop, outliving reloads.

A policy reload builds new filters over the same services: a rate-limit bucket, a breaker, a
JWKS cache, the health of a backend member or the sampler's buffer stays where it was. Each
feature keeps its state in one owner object that it gets with `services.get(KEY, factory)`: the
first call creates it, every later call (the next policy's filters) finds the same object.

A key is typed (as aiohttp's `AppKey[T]`): `ServiceKey[T]` names its owner's type, is defined
once, in its owner's module (`KEY: Final = ServiceKey[Owner]("name")`), and `get`/`peek` return
a `T`, so mypy rejects asking a key for another owner. At run time a second key object under a
name already taken, or a factory that builds something other than the key's type, raises
`TypeError` at once: two features can never share (and misread) one owner.

`aclose()` stops the background tasks started with `spawn` (bounded: a task that swallows its
cancellation is abandoned after `TASK_STOP_S`, never waited on for ever), then closes every
owner that has an `aclose` (or `close`) method, in reverse order of creation, each within
`OWNER_CLOSE_S`; owners whose key says `closes_last` (the clients other owners talk through,
e.g. Redis) close after all the others, whatever order they were created in, so an owner's
last words at stop (a lease given back, leaving the replica set) never reopen a closed client.
After it, `spawn` starts nothing.

What happens to a piece of state when its policy section changes is the owner's rule, stated in
its docstring (kept when its parameters did not change; re-sized or reset when they did).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar, get_args

from gateway.core.clock import Clock, MonotonicClock

log = logging.getLogger("sluice.services")

T = TypeVar("T")
TASK_STOP_S = 2.0  # how long `aclose` waits for its background tasks to end
OWNER_CLOSE_S = 5.0  # how long one owner's close may take


class ServiceKey(Generic[T]):
    """The typed name of one owner in the services: `ServiceKey[Owner]("name")`."""

    def __init__(
        self, name: str, owner: type[T] | None = None, *, closes_last: bool = False
    ) -> None:
        self.name = name
        self._owner = owner
        self.closes_last = closes_last  # closed after every other owner (a shared client)

    @property
    def owner(self) -> type[Any] | None:
        """The owner's class (from `ServiceKey[Owner]` or the second argument), if known."""
        if self._owner is None:
            args = get_args(getattr(self, "__orig_class__", None))
            if args and isinstance(args[0], type):
                self._owner = args[0]
        return self._owner

    def __repr__(self) -> str:
        owner = self.owner
        return f"ServiceKey({self.name!r}, {owner.__qualname__ if owner else '?'})"


class Services:
    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self._owners: dict[str, Any] = {}
        self._keys: dict[str, ServiceKey[Any]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False
        # Sheds a source address in the kernel for ttl seconds (None: the datapath's default);
        # False when the datapath is not running. Set by the server, which owns the datapath.
        self.deny: Callable[[str, float | None], bool] | None = None

    def get(self, key: ServiceKey[T], factory: Callable[[], T]) -> T:
        """The one owner of `key`, created by `factory()` on first use."""
        owner = self._owners.get(key.name)
        if owner is not None and self._keys[key.name] is key:
            return owner  # type: ignore[no-any-return]
        self._claim(key)
        owner = factory()
        cls = key.owner
        if cls is not None and not isinstance(owner, cls):
            raise TypeError(f"services key {key!r}: the factory built a {type(owner).__name__}")
        self._keys[key.name] = key
        self._owners[key.name] = owner
        return owner

    def peek(self, key: ServiceKey[T]) -> T | None:
        """The owner of `key` if it exists (for /readyz, /admin/state), else None."""
        if key.name in self._keys:
            self._claim(key)
        return self._owners.get(key.name)

    def _claim(self, key: ServiceKey[Any]) -> None:
        held = self._keys.get(key.name)
        if held is not None and held is not key:
            raise TypeError(
                f"services key {key.name!r} is already held by {held!r}; {key!r} is another "
                "key of that name (define each key once, in its owner's module)"
            )

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
        running loop; a task that fails is logged, never silently lost. Once the services are
        closed the coroutine never runs: the task returned is already cancelled."""
        task = asyncio.get_running_loop().create_task(coro, name=name or None)
        if self.closed:
            task.cancel()  # cancelled before its first step: the coroutine's body never runs
            return task
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    @property
    def tasks(self) -> int:
        """Background tasks still running."""
        return len(self._tasks)

    async def aclose(self) -> None:
        """Stop the background tasks, then close the owners (newest first). Bounded, never
        raises; a second call only waits for nothing."""
        first, self.closed = not self.closed, True
        await self._stop_tasks()
        if not first:
            return
        newest_first = reversed(self._owners.items())
        # (sorted is stable: newest first among each kind, the closes_last keys after the rest)
        for key, owner in sorted(newest_first, key=lambda ko: self._keys[ko[0]].closes_last):
            close = getattr(owner, "aclose", None) or getattr(owner, "close", None)
            if close is None:
                continue
            try:
                result = close()
                if inspect.isawaitable(result):
                    async with asyncio.timeout(OWNER_CLOSE_S):
                        await result
            except Exception:
                log.exception("closing %s failed", key)
        await self._stop_tasks()  # anything an owner's close spawned (nothing starts now)

    async def _stop_tasks(self) -> None:
        # A cancellation can be lost inside a client library (one that races its own timeout,
        # seen with redis-py on Python 3.11): cancel again every 0.1 s, and give up waiting
        # after TASK_STOP_S rather than hang the stop. Loops also check `closed` themselves.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TASK_STOP_S
        while self._tasks:
            pending = list(self._tasks)
            for t in pending:
                t.cancel()
            left = deadline - loop.time()
            if left <= 0:
                names = ", ".join(sorted(t.get_name() for t in pending))
                log.error("background tasks did not stop, abandoned: %s", names)
                self._tasks.clear()
                return
            await asyncio.wait(pending, timeout=min(0.1, left))
