"""Per-request cost of the policy-safety hooks on the hot path (not part of the test run).

    .venv/bin/python tests/bench/bench_traffic.py [--n 200000]

- `TrafficBook.record(ctx)`: what `Lifecycle.finish` (gateway/forward/lifecycle.py) adds to every
  request for the change guard;
- `Gateway.snapshot_for(info)` without a rollout (every request) and during a rollout's
  percentage stage and shadow stage (only while one runs);
- `RolloutController.record(snapshot, ctx)`: `Lifecycle.finish` during a rollout.

Each figure is the best of 5 rounds of `--n` calls, in µs per call, on this machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from gateway.app import Gateway  # noqa: E402
from gateway.context import RequestContext  # noqa: E402
from gateway.core.request import RequestInfo, Wire  # noqa: E402
from gateway.policy.model import Rollout  # noqa: E402
from tests.reload.traffic_support import BASE  # noqa: E402


def best(fn: Callable[[], object], n: int) -> float:
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return min(rounds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    n = args.n
    tmp = Path(tempfile.mkdtemp())
    path = tmp / "policy.yaml"
    path.write_text(BASE)
    gw = Gateway(path)
    info = RequestInfo(
        Wire.HTTP,
        "POST",
        "/v1/chat/completions",
        {"x-request-id": "0123456789abcdef0123456789abcdef", "content-type": "application/json"},
        "127.0.0.1:5555",
        "",
        300,
    )
    snap = gw.snapshot_for(info)
    ctx = RequestContext(info, snap.policy)
    ctx.route = snap.policy.match(info)
    assert ctx.route is not None
    ctx.endpoint = ctx.route.pick()
    ctx.bytes_in = 300
    ctx.first_byte_at = ctx.started + 0.02
    ctx.http_status = 200
    rows = [
        ("TrafficBook.record", best(lambda: gw.traffic.record(ctx), n)),
        ("snapshot_for, no rollout", best(lambda: gw.snapshot_for(info), n)),
    ]
    path.write_text(BASE.replace("9001", "9002"))
    gw.holder.reload(rollout=Rollout(stages=[5, 100], hold_s=3600, min_requests=10**9))
    ro = gw.holder.rollout
    assert ro is not None
    rows.append(("snapshot_for, rollout at 5 %", best(lambda: gw.snapshot_for(info), n)))
    rows.append(("RolloutController.record", best(lambda: ro.record(snap, ctx), n)))
    gw.holder.abort()
    path.write_text(BASE.replace("9001", "9003"))
    gw.holder.reload(rollout=Rollout(stages=["shadow", 100], hold_s=3600, min_requests=10**9))
    rows.append(("snapshot_for, shadow stage", best(lambda: gw.snapshot_for(info), n)))
    gw.holder.abort()
    width = max(len(r) for r, _ in rows)
    for name, us in rows:
        print(f"{name:<{width}}  {us:6.3f} µs/call")


if __name__ == "__main__":
    main()
