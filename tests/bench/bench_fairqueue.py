"""The fair queue's cost per request (by hand; not part of `make test`):

    .venv/bin/python tests/bench/bench_fairqueue.py [--tenants 1000] [--requests 200000]

In process: a pool of 8 busy slots with `--tenants` tenants waiting (two requests each, in three
classes); each step one request arrives (enqueue) and one in flight finishes (its counter
reconciled, the next one dispatched). Prints µs per step against the 5 µs budget; then what
the admission filter adds to the chain (on_request + on_response, request id and route) for an
uncontended request, one whose slot is free, and with the pool's slots leased from a fleet
store (`store:`; leases move in the background, so the request path is the same).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.context import RequestContext  # noqa: E402
from gateway.core.fairqueue import FairQueue, QueueParams, Waiter  # noqa: E402
from gateway.core.request import RequestInfo, Wire  # noqa: E402
from gateway.filters.registry import build_chain  # noqa: E402
from gateway.policy.compiled import compile_policy  # noqa: E402
from gateway.policy.model import Policy  # noqa: E402
from gateway.services import Services  # noqa: E402

BUDGET_US = 5.0


def run(tenants: int, requests: int) -> float:
    q = FairQueue(QueueParams(max_queued=10 * tenants), 8)
    names = [f"tenant-{i}" for i in range(tenants)]
    recs = [q.tenant(n, i % 3, 1.0 + i % 4) for i, n in enumerate(names)]
    flight: list[Waiter] = []
    for i in range(8 + 2 * tenants):
        w, _ = q.arrive(recs[i % tenants], i % tenants % 3, 0.0)
        assert isinstance(w, Waiter)
        if w.state == 1:
            flight.append(w)
    costs = [40.0 + (i * 37) % 200 for i in range(997)]
    t0 = time.perf_counter()
    now = 1.0
    for i in range(requests):
        now += 1e-4
        k = (i * 7919) % tenants
        q.arrive(recs[k], k % 3, now, None if i % 5 else now + 30.0)
        w = flight.pop(0)
        flight += q.finish(w, now, costs[i % 997], 0.02)
    el = time.perf_counter() - t0
    assert q.waiting >= tenants  # the queue stayed full of waiting tenants throughout
    return el / requests * 1e6


def chain_us(admission: bool, n: int = 100_000, tenants: int = 100, store: bool = False) -> float:
    doc: dict[str, object] = {
        "backends": [{"name": "a", "endpoints": [{"address": "127.0.0.1:1"}],
                      "max_in_flight": 10_000}],
        "routes": [{"name": "r", "backend": "a"}],
        "access_log": {"enabled": False},
    }  # fmt: skip
    if admission:
        doc["admission"] = {"fairness": {"key": ["header:x-tenant"]}}
    if store:  # slots leased from a fleet store (none answers here: the pool runs its share)
        doc["store"] = {"redis": {"url": "redis://127.0.0.1:9/0"}}
    p = compile_policy(Policy.model_validate(doc))
    chain = build_chain(p, Services())
    chain.activate()
    infos = [RequestInfo(Wire.HTTP, "GET", "/v1/models", {"x-tenant": f"t{i}"}, "10.0.0.1")
             for i in range(tenants)]  # fmt: skip
    for i in range(1000):
        ctx = RequestContext(infos[i % tenants], p)
        chain.run_request(ctx)
        chain.on_response_plain(ctx)
    t0 = time.perf_counter()
    for i in range(n):
        ctx = RequestContext(infos[i % tenants], p)
        chain.run_request(ctx)
        chain.on_response_plain(ctx)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=200_000)
    a = ap.parse_args()
    us = min(run(a.tenants, a.requests) for _ in range(3))
    verdict = "within" if us <= BUDGET_US else "OVER"
    print(f"fair queue, {a.tenants} tenants waiting: {us:.2f} µs per request "
          f"(enqueue + finish + dispatch), {verdict} the {BUDGET_US} µs budget")  # fmt: skip
    base = min(chain_us(False) for _ in range(3))
    adm = min(chain_us(True) for _ in range(3))
    print(f"chain on_request + on_response, a slot free: {base:.2f} µs without admission, "
          f"{adm:.2f} µs with it (+{adm - base:.2f} µs)")  # fmt: skip
    fleet = min(chain_us(True, store=True) for _ in range(3))
    print(f"with the pool's slots leased from a fleet store: {fleet:.2f} µs "
          f"({fleet - adm:+.2f} µs against admission alone)")  # fmt: skip


if __name__ == "__main__":
    main()
