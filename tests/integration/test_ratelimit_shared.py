"""Two gateway processes share one private redis-server: one global limit between them, and
what happens when Redis dies and comes back mid-run."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import Backend, Gateway, start_gateway
from tests.integration.load import offer
from tests.redis_support import RedisServer
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.redis]

LIMIT = 40  # requests per second, for both gateways together


def tail(redis_url: str) -> str:
    return f"""rate_limits:
  store: {{redis: {{url: "{redis_url}", sync_interval_ms: 50, deadline_ms: 20,
                   replica_ttl_s: 3}}}}
  rules:
    - name: global
      key: []
      qps: {LIMIT}
"""


def admin_json(gw: Gateway, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"{gw.admin}{path}", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # /readyz answers 503 with the same JSON
        with e:
            return json.loads(e.read())


def wait_mode(
    gws: list[Gateway], mode: str, replicas: int | None = None, timeout: float = 20
) -> None:
    wait_until(
        lambda: [admin_json(g, "/readyz")["ratelimit"] for g in gws],
        timeout,
        ok=lambda states: all(
            s["mode"] == mode and (replicas is None or s.get("replicas") == replicas)
            for s in states
        ),
        interval=0.1,
        what=f"all in mode {mode}" + (f" with {replicas} replicas" if replicas else ""),
    )


@pytest.fixture(scope="module")
def shared(
    backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RedisServer, Gateway, Gateway]]:
    redis = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    a = start_gateway(backend, tmp_path_factory.mktemp("gw-a"), tail=tail(redis.url))
    b = start_gateway(backend, tmp_path_factory.mktemp("gw-b"), tail=tail(redis.url))
    try:
        wait_mode([a, b], "redis", replicas=2)
        yield redis, a, b
    finally:
        for g in (a, b):
            assert g.proc.stop() == 0, g.proc.output()
        redis.stop()


def models(gws: list[Gateway]) -> Any:
    def request(i: int) -> tuple[str, str, dict[str, Any]]:
        return "GET", f"{gws[i % len(gws)].http}/v1/models", {}

    return request


async def test_two_gateways_enforce_one_global_limit(
    shared: tuple[RedisServer, Gateway, Gateway],
) -> None:
    _, a, b = shared
    duration = 4.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        await offer(s, 3 * LIMIT, 1.0, models([a, b]))  # warm up: leases, replica counts
        run = await offer(s, 3 * LIMIT, duration, models([a, b]))  # 3x the limit, split evenly
    admitted = run.count(200)
    ceiling = LIMIT * duration  # the most a perfect sliding window admits in that time
    overshoot = admitted / ceiling - 1
    print(f"admitted {admitted} of {len(run.results)} offered; ceiling {ceiling:.0f}; "
          f"overshoot {overshoot:+.1%}")  # fmt: skip
    assert run.statuses() <= {200, 429}
    assert admitted <= ceiling * 1.05, f"overshoot {overshoot:+.1%}"
    assert admitted >= ceiling * 0.75  # and the limit is not starved either
    for g in (a, b):
        assert run.count(200) and admin_json(g, "/admin/state")["ratelimit"]["mode"] == "redis"


async def test_two_gateways_admit_at_most_105_percent_of_one_limit_over_3_s(
    shared: tuple[RedisServer, Gateway, Gateway],
) -> None:
    """From a key at rest (its shares given back) to 4× the limit, split over both gateways:
    beyond its leased share each replica takes only its part of the room the last sync saw."""
    _, a, b = shared
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        await offer(s, LIMIT, 0.5, models([a, b]))
        await asyncio.sleep(3.0)  # idle past IDLE_S: the shares go back, the window empties
        # Start at the beginning of a store window (Redis TIME on this machine). Later in the
        # window, the sliding window itself admits more than 3 s worth from rest, on one
        # replica as on two: the first window's room is counted only for the part left of it.
        await asyncio.sleep(1.0 - time.time() % 1.0 + 0.02)
        run = await offer(s, 4 * LIMIT, 3.0, models([a, b]))
    admitted = run.count(200)
    print(f"admitted {admitted} of {len(run.results)}: {admitted / (3 * LIMIT):.3f}x one limit")
    assert run.statuses() <= {200, 429}
    assert admitted <= 1.05 * 3 * LIMIT


async def test_redis_killed_and_restarted_mid_run(
    shared: tuple[RedisServer, Gateway, Gateway],
) -> None:
    """All load on gateway A (B idle): with Redis, A may use the whole global limit; without
    it, A falls back to limit / live replicas; when Redis is back, sharing resumes."""
    redis, a, b = shared
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        shared_run = await offer(s, 3 * LIMIT, 3.0, models([a]))
        redis.stop()
        down = await offer(s, 3 * LIMIT, 3.0, models([a]))
        wait_mode([a, b], "fallback")
        redis.start()
        await asyncio.to_thread(wait_mode, [a, b], "redis")
        await offer(s, 3 * LIMIT, 1.0, models([a]))  # re-lease
        back = await offer(s, 3 * LIMIT, 3.0, models([a]))
    rates = [r.count(200, since=1.0) / 2.0 for r in (shared_run, down, back)]
    print(f"admitted/s at A: shared {rates[0]:.1f}, Redis down {rates[1]:.1f}, back {rates[2]:.1f}")
    for r in (shared_run, down, back):
        assert r.statuses() <= {200, 429}, r.statuses()  # never a 5xx, never a hang
        assert r.p99() < 1.0, r.p99()  # decisions keep coming, within the deadline
    assert rates[0] > 0.7 * LIMIT  # alone, A gets (almost) the whole global limit
    assert rates[1] < 0.75 * rates[0]  # Redis away: A keeps to its half (2 replicas known)
    assert rates[1] > 0.3 * LIMIT
    assert rates[2] > 0.8 * rates[0]  # back: A leases the whole limit again
    with urllib.request.urlopen(f"{a.admin}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'sluice_ratelimit_store_mode{mode="redis"} 1.0' in text
    assert "sluice_ratelimit_redis_errors_total" in text
