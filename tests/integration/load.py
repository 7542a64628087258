"""An open-loop load generator for integration tests: requests start on a schedule whatever the
answers do (a closed loop would slow down exactly when the gateway is under test)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Result:
    at: float  # seconds since the run started
    status: int  # 0: no answer (connection error, client timeout)
    latency: float
    tag: str = ""


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)

    def count(self, status: int | None = None, tag: str | None = None, since: float = 0.0,
              until: float = 1e9) -> int:  # fmt: skip
        return sum(
            1
            for r in self.results
            if (status is None or r.status == status)
            and (tag is None or r.tag == tag)
            and since <= r.at < until
        )

    def statuses(self) -> set[int]:
        return {r.status for r in self.results}

    def p99(self) -> float:
        lat = sorted(r.latency for r in self.results)
        return lat[int(len(lat) * 0.99)] if lat else 0.0


async def offer(
    session: aiohttp.ClientSession,
    rate: float,
    duration: float,
    request: Callable[[int], tuple[str, str, dict[str, Any]]],
    run: Run | None = None,
    t0: float | None = None,
    max_in_flight: int = 200,
) -> Run:
    """Start `rate` requests per second for `duration` seconds; `request(i)` gives (method,
    url, aiohttp kwargs + an optional "tag")."""
    run = run if run is not None else Run()
    start = time.monotonic()
    base = t0 if t0 is not None else start
    sem = asyncio.Semaphore(max_in_flight)
    tasks = []

    async def one(i: int) -> None:
        method, url, kw = request(i)
        tag = kw.pop("tag", "")
        t = time.monotonic()
        try:
            async with session.request(method, url, **kw) as r:
                await r.read()
                status = r.status
        except (TimeoutError, aiohttp.ClientError):
            status = 0
        finally:
            sem.release()
        run.results.append(Result(t - base, status, time.monotonic() - t, tag))

    n = int(rate * duration)
    for i in range(n):
        due = start + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await sem.acquire()
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return run
