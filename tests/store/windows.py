"""Runs a store test's steps inside one window of the store's clock.

The limits count requests in a sliding window: the previous window's count weighs less as the next
one goes on. Steps that expect exact counts see one more grant if a window boundary falls between
them, which happens to any run now and then. `one_window` runs the steps again, on fresh keys, until
every result's store clock (`SyncResult.now`, Redis TIME for Redis) lies in the same window.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence

from gateway.store.base import SyncResult

ATTEMPTS = 3


async def one_window(
    steps: Callable[[str], Awaitable[Sequence[SyncResult]]], window_s: float = 1.0
) -> Sequence[SyncResult]:
    """`steps(suffix)` uses keys named with `suffix` and returns every result it had, in order."""
    for n in range(ATTEMPTS):
        results = await steps(f"-{n}")
        windows = {math.floor(r.now / window_s) for r in results}
        if len(windows) == 1:
            return results
    raise AssertionError(f"{ATTEMPTS} runs each crossed a window boundary of the store's clock")
