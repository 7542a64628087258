"""`sluice bench --rounds N`: the HTTP ratios to the floor, measured in turn, N rounds.

One run of the floor and one of a Sluice row, minutes apart, move with the machine: on a shared
2-core host the floor alone measured 11 to 17.7 µs/request from run to run, and the ratio moved
with it (the same tree read 1.4× to 2.4× the floor). Here the floor proxy and a gateway of each
HTTP/1.1 variant run side by side, and each round measures all of them one after the other (the
order turned by one each round, so no row always runs first); a variant's ratio is the median of
its rounds' ratios to the floor of the same round, printed with the lowest and highest beside it
and read against the row's target. `--pair-duration` is each run's length.
"""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Callable
from typing import TypeVar

from gateway.bench.gateways import Setup, Variant, start_floor, start_gateway
from gateway.bench.loads import MakeCmd
from gateway.bench.report import FLOOR_TARGETS, Row

__all__ = ["ratio_note", "round_ratios", "rotated"]

MeasureFor = Callable[[Row, MakeCmd, int], Row]
T = TypeVar("T")


def rotated(items: list[T], turn: int) -> list[T]:
    """`items` started `turn` places later: round `turn`'s order."""
    k = turn % len(items) if items else 0
    return items[k:] + items[:k]


def ratio_note(label: str, ratios: list[float], rounds: int) -> str:
    """A variant's ratios to the floor, one per measured round, against its target."""
    if not ratios:
        return f"HTTP Sluice {label}: no round measured both it and the floor"
    mid = statistics.median(ratios)
    target = FLOOR_TARGETS.get(label.strip("()"))
    verdict = ""
    if target is not None:
        verdict = f" vs target ≤ {target} → {'PASS' if mid <= target else 'FAIL'}"
    return (
        f"HTTP Sluice {label} ÷ the floor, in turn: {mid:.2f}×, the median of {len(ratios)} of "
        f"{rounds} rounds ({min(ratios):.2f} … {max(ratios):.2f}){verdict}"
    )


def round_ratios(
    s: Setup, http_be: int, variants: list[Variant], rounds: int, measure_for: MeasureFor
) -> None:
    """Start the floor and a gateway per variant, measure them in turn `rounds` times, and add a
    note per variant (`ratio_note`)."""
    procs: list[subprocess.Popen[bytes]] = []
    runs: list[tuple[str, MakeCmd, int]] = []  # (label, load command, pid); the floor first
    try:
        floor, port = start_floor(s, http_be)
        procs.append(floor)
        runs.append(("floor", s.wrk(s.url(port)), floor.pid))
        for i, v in enumerate(variants):
            p, ports = start_gateway(s, http_be, None, v, f"rounds-{i}")
            procs.append(p)
            runs.append((v.label, s.wrk(s.url(ports["http"]), s.headers(v)), p.pid))
    except Exception as e:
        s.notes.append(f"rounds: a proxy did not start: {e}")
        for p in procs:
            s.procs.stop(p)
        return
    ratios: dict[str, list[float]] = {v.label: [] for v in variants}
    try:
        for turn in range(rounds):
            us: dict[str, float] = {}
            for label, cmd, pid in rotated(runs, turn):
                row = measure_for(Row(f"rounds {label}"), cmd, pid)
                if row.error is not None:
                    s.notes.append(f"rounds: {label}, round {turn + 1}: {row.error}")
                elif row.cpu_us_per_req:
                    us[label] = row.cpu_us_per_req
            base = us.get("floor")
            for label, got in ratios.items():
                if base and label in us:
                    got.append(us[label] / base)
    finally:
        for p in procs:
            s.procs.stop(p)
    for label, got in ratios.items():
        s.notes.append(ratio_note(label, got, rounds))
