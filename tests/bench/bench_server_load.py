"""Routing on the model servers' own figures, measured (by hand; not part of `make test`):

    .venv/bin/python tests/bench/bench_server_load.py [--seconds 8] [--clients 6] [--tokens 32]
        [--outside 12]

Three simulated members with 8 generation slots each (20 ms to first token, 10 ms per token),
two gateway replicas in front of them, `--clients` closed-loop streaming clients per replica
asking `--tokens` tokens, while an outside client (`--outside` closed-loop streams of 4 ×
`--tokens` tokens, straight to member 1, not through Sluice) keeps member 1's slots full and
its queue long. Two rows, the same members, one after the other: power of two choices on the
gateways' own counts (`p2c`), then `load.metrics` (vllm preset, 50 ms). Each row: member 1's
share of the gateways' requests, the clients' completions, and their p50/p99 time to first
token; then the ratios of the second row to the first.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.serverload_support import (  # noqa: E402
    busy_member_run,
    start_gateway,
    start_members,
)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


async def row(members: list, tmp: Path, metrics: bool, a: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    gws = [start_gateway(members, tmp / f"gw{i}-{metrics}", metrics) for i in range(2)]
    try:
        run, sent = await busy_member_run(gws, members, a.seconds, a.clients, a.tokens, a.outside)
    finally:
        for gw in gws:
            gw.proc.stop()
    total = sum(sent) or 1
    return {"share1": sent[0] / total, "sent": sent, "done": run.completed,
            "refused": sum(run.refused.values()), "p50": pct(run.ttft, 0.5),
            "p99": pct(run.ttft, 0.99)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=6, help="per gateway replica")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--outside", type=int, default=12, help="streams straight to member 1")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        members = start_members(tmp, 3, slots=8)
        try:
            rows = {name: asyncio.run(row(members, tmp, name == "load.metrics", a))
                    for name in ("p2c", "load.metrics")}  # fmt: skip
        finally:
            for m in members:
                m.proc.stop()
    print(f"3 members × 8 slots, 2 replicas × {a.clients} clients ({a.tokens} tokens), outside "
          f"{a.outside} streams on member 1, {a.seconds:g} s per row")  # fmt: skip
    print(f"{'row':<14}{'member 1 share':>16}{'sent (m1,m2,m3)':>20}{'done':>7}{'refused':>9}"
          f"{'p50 TTFT':>10}{'p99 TTFT':>10}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:<14}{r['share1']:>16.1%}{str(tuple(r['sent'])):>20}{r['done']:>7}"
              f"{r['refused']:>9}{r['p50'] * 1000:>8.0f}ms{r['p99'] * 1000:>8.0f}ms")  # fmt: skip
    p, m = rows["p2c"], rows["load.metrics"]
    print(f"load.metrics ÷ p2c: member 1 share {m['share1'] / max(p['share1'], 1e-9):.2f}× "
          f"(target ≤ 0.33), p99 TTFT {m['p99'] / p['p99']:.2f}× (target ≤ 0.6)")  # fmt: skip


if __name__ == "__main__":
    main()
