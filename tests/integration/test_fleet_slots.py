"""Backend slots held by a fleet: three gateway processes (one with two workers) share one
private redis-server and one simulated backend with `max_in_flight: 8`. The member never runs
more than 8, an idle replica's slots go to a busy one, a replica killed with SIGKILL gives its
slots back by lease expiry, and Redis killed and restarted mid-run costs no 5xx."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.admission_support import start_backend
from tests.integration.conftest import Backend, Gateway
from tests.integration.fleet_support import (
    admin_json,
    all_on_one,
    fleet_mode,
    kill,
    load,
    peak,
    reset_peak,
    slots_here,
    start_replica,
)
from tests.redis_support import RedisServer
from tests.support import metric_total, wait_until


def metrics_text(gw: Gateway) -> str:
    with urllib.request.urlopen(f"{gw.admin}/metrics", timeout=5) as r:
        return r.read().decode()


def readyz_fleets(gw: Gateway, samples: int) -> list[dict[str, object]]:
    """The `fleet` part of /readyz from `samples` fresh connections (each may reach another
    worker)."""
    return [admin_json(gw, "/readyz", 2)["fleet"] for _ in range(samples)]


pytestmark = [pytest.mark.integration, pytest.mark.redis]

SLOTS = 8


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[RedisServer, Backend, list[Gateway]]]:
    redis = RedisServer(tmp_path / "redis").start()
    backend = start_backend(tmp_path / "backend", 0, 30, 4)  # no slot limit: it shows the peak
    gws: list[Gateway] = []
    try:
        for i, workers in enumerate((2, 1, 1)):
            gws.append(start_replica(backend, tmp_path / f"gw{i}", redis.url, SLOTS, workers))
        wait_until(lambda: [fleet_mode(g) for g in gws], 20, interval=0.1,
                   ok=lambda ms: ms == ["shared"] * 3, what="every replica shared")  # fmt: skip
        # 4 processes; the store's first seconds cap grants at the fallback share (REBIRTH_S).
        wait_until(lambda: slots_here(gws[1])["live_replicas"], 20, ok=lambda n: n == 4)
        time.sleep(4.5)
        yield redis, backend, gws
    finally:
        for g in gws:
            if g.proc.popen.poll() is None:
                assert g.proc.stop() == 0, g.proc.output()[-3000:]
        backend.proc.stop()
        redis.stop()


async def test_the_member_never_runs_more_than_max_in_flight_and_uneven_load_moves(
    fleet: tuple[RedisServer, Backend, list[Gateway]],
) -> None:
    _, backend, gws = fleet
    reset_peak(backend)
    run = await load(gws, 24, 4.0)
    assert run.completed > 50 and not run.refused, run.refused
    assert peak(backend) <= SLOTS, peak(backend)
    # All clients on one single-worker replica: it gets (nearly) all the slots within 2 s.
    took, held, one = await all_on_one(gws[2], 24, 5.0, SLOTS)
    print(f"uneven: {held} of {SLOTS} slots in {took:.2f} s; peak {peak(backend)}")
    text = metrics_text(gws[1])
    assert metric_total(text, "sluice_fleet_store_mode", mode="shared") == 1
    assert metric_total(text, "sluice_fleet_replicas") == 4
    assert metric_total(text, "sluice_fleet_slots", pool="sim", kind="capacity") == SLOTS
    assert took < 2.0 + 0.3  # (the clients' starts are spread over 0.3 s)
    assert not one.refused and peak(backend) <= SLOTS


async def test_sigkill_and_redis_restart_mid_run(
    fleet: tuple[RedisServer, Backend, list[Gateway]],
) -> None:
    redis, backend, gws = fleet
    a, b, c = gws
    # C takes every slot, then dies with them: A and B, waiting, get them back by expiry.
    task_c = asyncio.create_task(load([c], 24, 3.0))
    await asyncio.to_thread(wait_until, lambda: slots_here(c)["in_flight_here"], 5,
                            ok=lambda n: n >= SLOTS - 1, interval=0.05)  # fmt: skip
    task_ab = asyncio.create_task(load([a, b], 24, 8.0))
    await asyncio.sleep(0)  # A's and B's clients start; C still holds every slot
    kill(c)
    t0 = time.monotonic()
    await asyncio.gather(task_c, return_exceptions=True)  # its clients see broken connections
    # Its requests end at the backend as their connections close; in the store C holds its
    # slots until its lease expires, then A and B take them.
    low = await asyncio.to_thread(wait_until, lambda: backend.stats()["generating"], 3,
                                  ok=lambda n: n <= 2, interval=0.02)  # fmt: skip
    await asyncio.to_thread(wait_until, lambda: backend.stats()["generating"], 5,
                            ok=lambda n: n >= SLOTS - 1, interval=0.05)  # fmt: skip
    back_s = time.monotonic() - t0
    print(f"slots of the killed replica back in use after {back_s:.2f} s (low: {low})")
    assert back_s <= 2 * 1.0 + 0.5  # two lease lifetimes (1 s), and a sync or two
    # Redis dies mid-run: every replica in fallback within a second, no 5xx.
    reset_peak(backend)
    redis.stop()
    t1 = time.monotonic()
    await asyncio.to_thread(wait_until, lambda: [fleet_mode(g) for g in (a, b)], 3,
                            ok=lambda ms: ms == ["fallback"] * 2, interval=0.05)  # fmt: skip
    to_fallback = time.monotonic() - t1
    assert metric_total(metrics_text(a), "sluice_fleet_store_mode", mode="fallback") == 1
    # A runs two workers, and the admin port reaches one worker a connection: each decides on
    # its own, so wait until eight connections in a row find fallback, then each says why.
    seen = await asyncio.to_thread(wait_until, lambda: readyz_fleets(a, 8), 2,
                                   ok=lambda fs: all(f["mode"] == "fallback" for f in fs),
                                   interval=0.05)  # fmt: skip
    assert all("store_error" in f for f in seen), seen
    await asyncio.sleep(1.0)
    redis.start()
    t2 = time.monotonic()
    await asyncio.to_thread(wait_until, lambda: [fleet_mode(g) for g in (a, b)], 8,
                            ok=lambda ms: ms == ["shared"] * 2, interval=0.05)  # fmt: skip
    to_shared = time.monotonic() - t2
    run = await task_ab
    print(f"fallback after {to_fallback:.2f} s, shared again {to_shared:.2f} s after Redis "
          f"returned; peak {peak(backend)}; refused {run.refused}")  # fmt: skip
    assert to_fallback < 1.0
    assert to_shared < 5.0
    assert not any(s >= 500 for s in run.refused), run.refused
    assert run.completed > 50
    # In fallback each of the 3 live processes runs 8 // 4 (the last known count): ≤ 8.
    assert peak(backend) <= SLOTS
