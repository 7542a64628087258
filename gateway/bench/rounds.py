"""`sluice bench --rounds N`: the ratios to the floors, measured in turn, N rounds.

One run of the floor and one of a Sluice row, minutes apart, move with the machine: on a shared
2-core host the floor alone measured 11 to 17.7 µs/request from run to run, and the ratio moved
with it (the same tree read 1.4× to 2.4× the floor). Here the floor proxy and a gateway of each
HTTP/1.1 variant run side by side (with h2load, the HTTP/2 floor too, and the native gateways are
driven over h2c as well), and each round measures all of them one after the other (the order
turned by one each round, so no run always comes first). A row's ratio is the median of its
rounds' ratios to the floor of the same round (HTTP/1.1 rows to the HTTP floor, HTTP/2 rows to
the HTTP/2 floor), printed with the lowest and highest beside it and read against the row's
target. With `--grpc-engine both`, a gateway of each gRPC engine runs side by side too, and the
h2 engine's ratio to the grpcio engine is taken the same way. `--pair-duration` is each run's
length.
"""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from gateway.bench.gateways import Setup, Variant, start_floor, start_gateway, start_h2floor
from gateway.bench.loads import MakeCmd, Parse, parse_wrk
from gateway.bench.report import FLOOR_TARGETS, GRPC_H2_TARGET, H2_VS_FLOOR_TARGET, Row

__all__ = [
    "grpc_round_ratios",
    "in_turn",
    "ratio_note",
    "round_ratios",
    "rotated",
    "row_target",
    "side_by_side",
]

# Measures one run: (row, load command, its parser, the measured process) → the row.
Measure = Callable[[Row, MakeCmd, Parse, int], Row]
T = TypeVar("T")


def rotated(items: list[T], turn: int) -> list[T]:
    """`items` started `turn` places later: round `turn`'s order."""
    k = turn % len(items) if items else 0
    return items[k:] + items[:k]


def ratio_note(
    name: str, ratios: list[float], rounds: int, floor: str, target: float | None
) -> str:
    """A row's ratios to its floor, one per measured round, against its target."""
    if not ratios:
        return f"{name}: no round measured both it and {floor}"
    mid = statistics.median(ratios)
    verdict = ""
    if target is not None:
        verdict = f" vs target ≤ {target} → {'PASS' if mid <= target else 'FAIL'}"
    return (
        f"{name} ÷ {floor}, in turn: {mid:.2f}×, the median of {len(ratios)} of {rounds} "
        f"rounds ({min(ratios):.2f} … {max(ratios):.2f}){verdict}"
    )


class Run(NamedTuple):
    """One measured run of a round: a row's name, its floor's (None: it is a floor), the load."""

    name: str
    floor: str | None
    cmd: MakeCmd
    parse: Parse
    pid: int


# The HTTP/2 rows' load: (run name, URL, headers) → the h2load command and its parser.
H2Load = Callable[[str, str, list[str]], tuple[MakeCmd, Parse]]

HTTP_FLOOR = "the floor"
H2_FLOOR = "the HTTP/2 floor"
GRPC_ENGINES = ("grpcio", "h2")  # the gRPC rounds: the h2 engine read against the grpcio one


def round_ratios(
    s: Setup,
    http_be: int,
    variants: list[Variant],
    rounds: int,
    measure: Measure,
    h2load: H2Load | None = None,
) -> None:
    """Start the floors and a gateway per variant, measure them in turn `rounds` times, and add
    a note per row (`ratio_note`)."""

    def start(procs: list[subprocess.Popen[bytes]], runs: list[Run]) -> None:
        floor, port = start_floor(s, http_be)
        procs.append(floor)
        runs.append(Run(HTTP_FLOOR, None, s.wrk(s.url(port)), parse_wrk, floor.pid))
        if h2load is not None:
            h2floor, port = start_h2floor(s, http_be)
            procs.append(h2floor)
            runs.append(
                Run(H2_FLOOR, None, *h2load("rounds-h2floor", s.url(port), []), h2floor.pid)
            )
        for i, v in enumerate(variants):
            p, ports = start_gateway(s, http_be, None, v, f"rounds-{i}")
            procs.append(p)
            url, headers = s.url(ports["http"]), s.headers(v)
            runs.append(
                Run(f"HTTP Sluice {v.label}", HTTP_FLOOR, s.wrk(url, headers), parse_wrk, p.pid)
            )
            if h2load is not None and v.engine == "native":
                cmd, parse = h2load(f"rounds-h2-{i}", url, headers)
                runs.append(Run(f"HTTP/2 Sluice {v.label}", H2_FLOOR, cmd, parse, p.pid))

    for r, ratios in side_by_side(s, start, rounds, measure):
        s.notes.append(ratio_note(r.name, ratios, rounds, str(r.floor), row_target(r.name)))


def grpc_round_ratios(
    s: Setup, grpc_be: int, chain: tuple[str, ...] | None, rounds: int, measure: Measure
) -> None:
    """A gateway per gRPC engine side by side, measured in turn `rounds` times; a note with the
    h2 engine's median ratio to the grpcio engine's CPU per call (`GRPC_H2_TARGET`)."""
    variants = [Variant(None, chain, grpc_engine=e) for e in GRPC_ENGINES]
    base = f"gRPC Sluice {variants[0].label}"

    def start(procs: list[subprocess.Popen[bytes]], runs: list[Run]) -> None:
        for v in variants:
            name = f"rounds-grpc-{v.grpc_engine}"
            p, ports = start_gateway(s, None, grpc_be, v, name)
            procs.append(p)
            cmd, parse = s.grpc(name, ports["grpc"])
            label = f"gRPC Sluice {v.label}"
            runs.append(Run(label, None if label == base else base, cmd, parse, p.pid))

    for r, ratios in side_by_side(s, start, rounds, measure):
        s.notes.append(ratio_note(r.name, ratios, rounds, base, GRPC_H2_TARGET))


# Starts the processes of a round (appended to the first list, even when it fails part way) and
# lists their runs (the second).
Start = Callable[[list[subprocess.Popen[bytes]], list[Run]], None]


def side_by_side(
    s: Setup, start: Start, rounds: int, measure: Measure
) -> list[tuple[Run, list[float]]]:
    """`start`, then `in_turn`, then every process started is stopped. Each run with a floor and
    its ratios; none (and a note) when a process did not start."""
    procs: list[subprocess.Popen[bytes]] = []
    runs: list[Run] = []
    try:
        try:
            start(procs, runs)
        except Exception as e:
            s.notes.append(f"rounds: a proxy did not start: {e}")
            return []
        ratios = in_turn(s, runs, rounds, measure)
        return [(r, ratios[r.name]) for r in runs if r.floor is not None]
    finally:
        for p in procs:
            s.procs.stop(p)


def in_turn(s: Setup, runs: list[Run], rounds: int, measure: Measure) -> dict[str, list[float]]:
    """Each run measured once a round, the order turned by one each round: per run with a floor,
    its ratio to that floor in every round that measured both."""
    ratios: dict[str, list[float]] = {r.name: [] for r in runs if r.floor is not None}
    for turn in range(rounds):
        us: dict[str, float] = {}
        for r in rotated(runs, turn):
            row = measure(Row(f"rounds {r.name}"), r.cmd, r.parse, r.pid)
            if row.error is not None:
                s.notes.append(f"rounds: {r.name}, round {turn + 1}: {row.error}")
            elif row.cpu_us_per_req:
                us[r.name] = row.cpu_us_per_req
        for r in runs:
            base = us.get(r.floor) if r.floor is not None else None
            if base and r.name in us:
                ratios[r.name].append(us[r.name] / base)
    return ratios


def row_target(name: str) -> float | None:
    """The row's target: `FLOOR_TARGETS` for an HTTP/1.1 row, `H2_VS_FLOOR_TARGET` for HTTP/2."""
    if name.startswith("HTTP/2"):
        return H2_VS_FLOOR_TARGET
    return FLOOR_TARGETS.get(name.partition("(")[2].rstrip(")"))
