"""A fleet of gateways holding one member's `max_in_flight`, measured (by hand; not part of
`make test`). Real processes: a private redis-server, a simulated backend without a slot limit
of its own (so its peak of requests generating at once is what the gateways sent it), gateway
replicas sharing the store (`store:`), an admission queue and `max_in_flight: 8`, and real
streaming clients (httpx):

    .venv/bin/python tests/bench/bench_fleet.py slots [--seconds 6] [--workers 2]
    .venv/bin/python tests/bench/bench_fleet.py store-ops [--seconds 5]
    .venv/bin/python tests/bench/bench_fleet.py fairness [--seconds 6]

- `slots`: 48 clients for `--seconds`: one replica alone (no store: the baseline), then the same
  clients spread over 2 and over 3 replicas (each with `--workers`): requests served (and as a
  share of the baseline), the backend's peak of requests at once; then uneven load (every
  client on one of the 3 replicas, one worker): how soon it runs 7 of the 8 slots.
- `fairness`: a backend with 8 generation slots (20 ms to first token, 10 ms per token); tenant
  B (2 clients, 16 tokens) on replica 1 alone, then beside tenant A (24 clients, 64 tokens)
  spread over replicas 1 and 2 (admission with the documented defaults, `max_in_flight: 8` for
  the fleet); and the same clients through one gateway without a queue: B's completions as a
  share of alone, B's p99 time to first token, the tokens served against the no-queue run.
- `store-ops`: Redis commands per second per gateway process (INFO commandstats, before and
  after), idle and under load, and the extrapolation to 50 replicas × 20 pools.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from tests.integration.admission_support import (  # noqa: E402
    TenantRun,
    client,
    start,
    start_backend,
)
from tests.integration.conftest import Backend, Gateway  # noqa: E402
from tests.integration.fleet_support import (  # noqa: E402
    all_on_one,
    fleet_mode,
    load,
    peak,
    reset_peak,
    slots_here,
    start_replica,
)
from tests.redis_support import RedisServer  # noqa: E402
from tests.support import wait_until  # noqa: E402

SLOTS = 8
CLIENTS = 48
TOKENS = 16


@contextmanager
def stage(slots: int, ttft_ms: int, token_ms: int) -> Iterator[tuple[Path, RedisServer, Backend]]:
    """A temporary directory, a private redis-server and a simulated backend, stopped after."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-fleet-") as d:
        tmp = Path(d)
        redis = RedisServer(tmp / "redis").start()
        backend = start_backend(tmp / "backend", slots, ttft_ms, token_ms)
        try:
            yield tmp, redis, backend
        finally:
            backend.proc.stop()
            redis.stop()


def fleet(backend: Backend, tmp: Path, redis: RedisServer | None, n: int,
          workers: int) -> list[Gateway]:  # fmt: skip
    url = redis.url if redis is not None else None
    gws = [start_replica(backend, tmp / f"gw{n}-{i}", url, SLOTS, workers) for i in range(n)]
    if redis is not None:
        wait_until(lambda: [fleet_mode(g) for g in gws], 30, interval=0.1,
                   ok=lambda ms: ms == ["shared"] * n, what="every replica shared")  # fmt: skip
        wait_until(lambda: slots_here(gws[0])["live_replicas"], 30, interval=0.1,
                   ok=lambda c: c == n * workers)  # fmt: skip
        time.sleep(4.5)  # past the store's first seconds (grants capped at the fallback share)
    return gws


def stop(gws: list[Gateway]) -> None:
    for g in gws:
        g.proc.stop()


def served(backend: Backend, gws: list[Gateway], seconds: float) -> tuple[int, int, dict[int, int]]:
    reset_peak(backend)
    run = asyncio.run(load(gws, CLIENTS, seconds, TOKENS))
    return run.completed, peak(backend), run.refused


def cmd_slots(args: argparse.Namespace) -> None:
    with stage(0, 20, 3) as (tmp, redis, backend):
        rows = []
        one = fleet(backend, tmp, None, 1, 1)
        asyncio.run(load(one, CLIENTS, 1.0, TOKENS))  # warm up
        base, base_peak, base_ref = served(backend, one, args.seconds)
        stop(one)
        rows.append(("one replica, no store", base, base_peak, base_ref))
        for n in (2, 3):
            gws = fleet(backend, tmp, redis, n, args.workers)
            asyncio.run(load(gws, CLIENTS, 1.0, TOKENS))
            got, pk, ref = served(backend, gws, args.seconds)
            stop(gws)
            rows.append((f"{n} replicas × {args.workers} workers, shared", got, pk, ref))
        print(f"{CLIENTS} clients, {args.seconds:g} s, max_in_flight {SLOTS}, {TOKENS} tokens "
              "per request (20 ms to first token, 3 ms per token)")  # fmt: skip
        print(f"{'setup':<34} {'served':>7} {'of one':>7} {'peak':>5}  refused")
        for name, got, pk, ref in rows:
            print(f"{name:<34} {got:>7} {got / base:>7.1%} {pk:>5}  {ref or '-'}")
        # Uneven: every client on one of three single-worker replicas.
        gws = fleet(backend, tmp, redis, 3, 1)
        asyncio.run(load(gws, CLIENTS, 1.0, TOKENS))
        time.sleep(1.5)  # idle: the warm-up's leases go back
        reset_peak(backend)

        took, n, _ = asyncio.run(all_on_one(gws[2], CLIENTS, 4.0, SLOTS, TOKENS))
        stop(gws)
        print(
            f"uneven load (all {CLIENTS} clients on 1 of 3 replicas): {n} of {SLOTS} slots "
            f"in use after {took:.2f} s (clients start over 0.3 s); peak {peak(backend)}"
        )


def commands(redis: RedisServer) -> int:
    import redis as redis_py

    c = redis_py.Redis.from_url(redis.url)
    try:
        stats = c.info("commandstats")
    finally:
        c.close()
    # Script calls (what a replica sends); the commands a script runs inside are not counted.
    return sum(
        int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
    )


def cmd_store_ops(args: argparse.Namespace) -> None:
    with stage(0, 20, 3) as (tmp, redis, backend):
        gws = fleet(backend, tmp, redis, 2, 1)
        procs = 2
        time.sleep(2.0)
        c0 = commands(redis)
        time.sleep(args.seconds)
        idle = (commands(redis) - c0) / args.seconds / procs
        c1 = commands(redis)
        t1 = time.monotonic()
        asyncio.run(load(gws, CLIENTS, args.seconds, TOKENS))
        busy = (commands(redis) - c1) / (time.monotonic() - t1) / procs
        stop(gws)
        print(
            f"store script calls per second per gateway process ({procs} processes, one pool, "
            f"sync_interval_ms 50): idle {idle:.1f}, loaded ({CLIENTS} clients) {busy:.1f}"
        )
        # One announce per second per process whatever the pools; per loaded pool the rest.
        per_pool = max(busy - idle, 0.0)
        est = 50 * (idle + 20 * per_pool)
        print(
            f"50 replicas × 20 pools, every pool loaded: ≈ {est:,.0f} script calls/s "
            f"(idle: {50 * idle:,.0f})"
        )


async def tenants(
    b_gw: Gateway, a_gws: list[Gateway], seconds: float
) -> tuple[TenantRun, TenantRun]:
    """B: 2 clients × 16 tokens on `b_gw`; A: 24 clients × 64 tokens spread over `a_gws`
    (none if empty), their starts spread over one of A's generations."""
    a, b = TenantRun("A"), TenantRun("B")
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http:
        until = time.monotonic() + seconds
        tasks = [client(http, f"{b_gw.http}/v1/chat/completions", b, 16, until) for _ in range(2)]
        tasks += [client(http, f"{a_gws[i % len(a_gws)].http}/v1/chat/completions", a, 64, until,
                         delay=0.65 * i / 24) for i in range(24 if a_gws else 0)]  # fmt: skip
        await asyncio.gather(*tasks)
    return a, b


def cmd_fairness(args: argparse.Namespace) -> None:
    with stage(8, 20, 10) as (tmp, redis, backend):
        plain = start(backend, tmp / "plain", max_in_flight=None, queue=False)
        try:
            na, nb = asyncio.run(tenants(plain, [plain], args.seconds))
        finally:
            plain.proc.stop()
        gws = fleet(backend, tmp, redis, 2, 1)
        try:
            _, alone = asyncio.run(tenants(gws[0], [], args.seconds))
            a, b = asyncio.run(tenants(gws[0], gws, args.seconds))
        finally:
            stop(gws)
        none_tokens = na.served() + nb.served()
        tokens = a.served() + b.served()
        print(f"fairness across 2 replicas, {args.seconds:g} s, 8 slots (B: 2 clients × 16 "
              "tokens on replica 1; A: 24 × 64 over replicas 1 and 2)")  # fmt: skip
        print(f"no queue (one gateway): B {nb.completed} done, p99 TTFT "
              f"{nb.p99_ttft() * 1000:.0f} ms, tokens {none_tokens}")  # fmt: skip
        print(f"fleet: B alone {alone.completed}, with A {b.completed} "
              f"({b.completed / max(alone.completed, 1):.0%} of alone), B p99 TTFT "
              f"{b.p99_ttft() * 1000:.0f} ms, tokens {tokens} "
              f"({tokens / max(none_tokens, 1):.1%} of no queue), A done {a.completed}, "
              f"refused A {a.refused or '-'} B {b.refused or '-'}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("slots")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--workers", type=int, default=2)
    p.set_defaults(fn=cmd_slots)
    p = sub.add_parser("fairness")
    p.add_argument("--seconds", type=float, default=6.0)
    p.set_defaults(fn=cmd_fairness)
    p = sub.add_parser("store-ops")
    p.add_argument("--seconds", type=float, default=5.0)
    p.set_defaults(fn=cmd_store_ops)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
