"""Fair admission, measured (by hand; not part of `make test`). Each part starts a simulated
backend with 8 generation slots (20 ms to first token, 10 ms per token) and gateways in front of
it, with real streaming clients (httpx), and keeps under ~50 s (each phase 6 or 10 s):

    .venv/bin/python tests/bench/bench_admission.py two-tenants [--seconds 6] [--anticipate-ms 20]
    .venv/bin/python tests/bench/bench_admission.py shares [--seconds 10]
    .venv/bin/python tests/bench/bench_admission.py classes [--seconds 6] [--anticipate-ms MS]
        [--reserve SHARE]

- `two-tenants`: tenant B (2 clients, 16 tokens each) alone, then beside tenant A (24 clients,
  64 tokens), through a gateway without the queue (the backend's own FIFO queue holds what it
  cannot run), one with the queue as the docs write it (`max_in_flight: 8`, the defaults:
  anticipation 20 ms) and one with a work-conserving queue (`anticipate_ms: 0`); side by side:
  B's completions (and as a share of alone), B's p99 time to first token, the tokens served, the
  longest wait; `--anticipate-ms` other than 0 and 20 adds a row with it.
- `shares`: two tenants of 16 clients each (64 tokens), weights 1 and 2, both asking for more
  than half of the capacity: their served-token shares ÷ weights, Jain's index per 2 s window
  and over the whole run.
- `classes`: gold, silver and free, 8 clients each (3× the capacity), `max_wait_ms` 2000: each
  class's completions, refusals and p99 time to first token, gold's against its p99 alone;
  `--anticipate-ms` and `--reserve` set `queue.anticipate_ms` and `priority.reserve: {share,
  rank: gold}`. With a reserve, its price too: the tokens served while gold is idle (silver and
  free, 8 clients each), with and without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.admission_support import (  # noqa: E402
    TenantRun,
    admission,
    client,
    start,
    start_backend,
    two_tenants,
)
from tests.integration.conftest import Backend, Gateway  # noqa: E402


def longest_wait_ms(gw: Gateway) -> float:
    waits = [json.loads(line[line.index("{") :]).get("queue_wait_ms", 0.0)
             for line in gw.proc.output().splitlines() if '"queue_wait_ms"' in line]  # fmt: skip
    return max(waits, default=0.0)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 1.0


async def two(be: Backend, tmp: Path, seconds: float, anticipate_ms: float) -> None:
    rows = []
    # No queue; the queue as the docs write it (the defaults: anticipation 20 ms); a
    # work-conserving queue (anticipate_ms: 0); and --anticipate-ms when it is another value.
    runs: list[tuple[bool, float | None]] = [(False, None), (True, None), (True, 0.0)]
    if anticipate_ms not in (0.0, 20.0):
        runs.append((True, anticipate_ms))
    for queue, ant in runs:
        gw = start(be, tmp / f"q{queue}{ant}", max_in_flight=8 if queue else None, queue=queue,
                   section=admission(anticipate_ms=ant))  # fmt: skip
        try:
            _, alone = await two_tenants(gw, seconds, with_a=False)
            a, b = await two_tenants(gw, seconds, with_a=True)
            wait = longest_wait_ms(gw)
        finally:
            gw.proc.stop()
        rows.append((queue, alone, a, b, wait, ant))
    print(f"two tenants, {seconds:g} s each, 8 slots (B: 2 clients × 16 tokens; A: 24 × 64)")
    print(f"{'':22}{'B alone':>9}{'B with A':>10}{'B share':>9}{'B p99 TTFT':>12}"
          f"{'tokens':>8}{'B tokens':>10}{'A done':>8}{'max wait':>10}")  # fmt: skip
    for queue, alone, a, b, wait, ant in rows:
        name = "no queue" if not queue else (
            "queue, defaults" if ant is None else f"queue, anticipate {ant:g}ms")  # fmt: skip
        tokens = a.served() + b.served()
        print(f"{name:22}{alone.completed:>9}{b.completed:>10}"
              f"{b.completed / max(alone.completed, 1):>9.0%}{b.p99_ttft() * 1000:>10.0f}ms"
              f"{tokens:>8}{b.served() / max(tokens, 1):>10.1%}{a.completed:>8}"
              f"{wait:>8.0f}ms")  # fmt: skip
    today = rows[0]
    for new in rows[1:]:
        kept = (new[2].served() + new[3].served()) / max(today[2].served() + today[3].served(), 1)
        what = "defaults" if new[5] is None else f"anticipate {new[5]:g}ms"
        print(f"tokens served, queue ({what}) ÷ no queue: {kept:.1%}")


async def shares(be: Backend, tmp: Path, seconds: float) -> None:
    gw = start(be, tmp / "shares", max_in_flight=8, queue=True)
    runs = {"light": (TenantRun("light"), 1.0), "heavy": (TenantRun("heavy"), 2.0)}
    url = f"{gw.http}/v1/chat/completions"
    try:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http:
            t0 = time.monotonic()
            until = t0 + seconds
            await asyncio.gather(*(
                client(http, url, run, 64, until, {"x-weight": str(w)}, delay=0.65 * i / 16)
                for run, w in runs.values() for i in range(16)
            ))  # fmt: skip
    finally:
        gw.proc.stop()
    print(f"shares, {seconds:g} s, 8 slots, two tenants × 16 clients × 64 tokens, weights 1 : 2")
    windows = []
    step = 2.0
    for k in range(int(seconds // step)):
        lo, hi = t0 + k * step, t0 + (k + 1) * step
        per = [run.served(lo, hi) / w for run, w in runs.values()]
        windows.append(jain(per))
    total = sum(run.served() for run, _ in runs.values()) or 1
    for name, (run, w) in runs.items():
        print(f"  {name:6} weight {w:g}: {run.served() / total:.1%} of the tokens "
              f"(weight share {w / 3:.1%}), {run.completed} done")  # fmt: skip
    whole = jain([run.served() / w for run, w in runs.values()])
    print(f"  Jain's index over the run {whole:.3f}; per {step:g} s window "
          f"min {min(windows):.3f}, mean {sum(windows) / len(windows):.3f}")  # fmt: skip


async def classes(be: Backend, tmp: Path, seconds: float, anticipate_ms: float,
                  reserve: float) -> None:  # fmt: skip
    gw = start(be, tmp / "classes", max_in_flight=8, queue=True,
               section=admission(2000, anticipate_ms, reserve))  # fmt: skip
    url = f"{gw.http}/v1/chat/completions"
    try:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http:
            quiet = TenantRun("gold")
            await asyncio.gather(*(client(http, url, quiet, 16, time.monotonic() + 3.0,
                                          {"x-tier": "gold"}) for _ in range(8)))  # fmt: skip
            runs = {c: TenantRun(c) for c in ("gold", "silver", "free")}
            until = time.monotonic() + seconds
            await asyncio.gather(*(client(http, url, run, 16, until, {"x-tier": c})
                                   for c, run in runs.items() for _ in range(8)))  # fmt: skip
        with urllib.request.urlopen(f"{gw.admin}/admin/state", timeout=5) as r:
            refused = json.loads(r.read())["admission"]["pools"][0]["refused"]
    finally:
        gw.proc.stop()
    print(f"classes, {seconds:g} s, 8 slots, gold / silver / free × 8 clients × 16 tokens (3x); "
          f"anticipate_ms {anticipate_ms:g}, reserve share {reserve:g} (rank gold)")  # fmt: skip
    print(f"  gold alone (its 8 clients): p99 time to first token {quiet.p99_ttft() * 1000:.0f} ms")
    for c, run in runs.items():
        print(f"  {c:6}: {run.completed:4} done, {sum(run.refused.values()):4} refused, "
              f"p99 time to first token {run.p99_ttft() * 1000:.0f} ms")  # fmt: skip
    g = runs["gold"].p99_ttft() / quiet.p99_ttft()
    print(f"  gold loaded ÷ unloaded p99: {g:.2f}; refusals by reason: {refused}")
    print(f"  tokens served: {sum(run.served() for run in runs.values())}")
    if reserve:
        await gold_idle(be, tmp, seconds, anticipate_ms, reserve)


async def gold_idle(be: Backend, tmp: Path, seconds: float, anticipate_ms: float,
                    reserve: float) -> None:  # fmt: skip
    """The reserve's price: gold idle, silver and free (8 clients each) ask for 2x the slots;
    the tokens served with the reserve ÷ without it."""
    served = []
    for share in (0.0, reserve):
        gw = start(be, tmp / f"idle{share}", max_in_flight=8, queue=True,
                   section=admission(2000, anticipate_ms, share))  # fmt: skip
        url = f"{gw.http}/v1/chat/completions"
        try:
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http:
                runs = {c: TenantRun(c) for c in ("silver", "free")}
                until = time.monotonic() + seconds
                await asyncio.gather(*(client(http, url, run, 16, until, {"x-tier": c})
                                       for c, run in runs.items() for _ in range(8)))  # fmt: skip
        finally:
            gw.proc.stop()
        served.append(sum(run.served() for run in runs.values()))
    print(
        f"  gold idle (silver + free × 8 clients): tokens served {served[0]} without the "
        f"reserve, {served[1]} with it ({served[1] / max(served[0], 1):.1%})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["two-tenants", "shares", "classes"])
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument(
        "--anticipate-ms",
        type=float,
        default=20.0,
        help="two-tenants: the third row's admission.queue.anticipate_ms; classes: "
        "the gateway's (default 20 for two-tenants, 0 for classes)",
    )
    ap.add_argument(
        "--reserve",
        type=float,
        default=0.0,
        help="classes: admission.priority.reserve.share for gold (0: none)",
    )
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        be = start_backend(tmp, slots=8, ttft_ms=20, token_ms=10)
        try:
            if a.what == "two-tenants":
                asyncio.run(two(be, tmp, a.seconds or 6.0, a.anticipate_ms))
            elif a.what == "shares":
                asyncio.run(shares(be, tmp, a.seconds or 10.0))
            else:
                ant = a.anticipate_ms if "--anticipate-ms" in sys.argv else 0.0
                asyncio.run(classes(be, tmp, a.seconds or 6.0, ant, a.reserve))
        finally:
            be.proc.stop()


if __name__ == "__main__":
    main()
