"""Each full-chain feature's cost in place, measured in pairs (`sluice bench --full`).

A feature costs a few µs per request, about what two runs of the same gateway differ by on a
shared machine, so one run of the full chain against one of the chain without the feature
says little (the same tree gave auth −2.0 and +3.0 µs in two runs). Instead, for each feature,
a full-chain gateway and a gateway without the feature are started together (the same age) and
measured in turn,
`--pairs` times (full first in the odd pairs, last in the even ones); the feature's cost is the
median of the pairs' differences, with their lowest and highest beside it. A drift of the
machine's speed moves both runs of a pair alike, as it does not move two rows measured minutes
apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from gateway.bench.full import BUDGET_US, FEATURES
from gateway.bench.gateways import Setup, Variant, start_gateway
from gateway.bench.loads import MakeCmd
from gateway.bench.report import Row

__all__ = [
    "CONTROL",
    "REFERENCE_FLOOR_US",
    "PairCost",
    "feature_costs",
    "pair_cost",
    "scaled_budget",
]

# The pair that measures the full chain against a second copy of itself: the method's own offset
# and spread, which a feature's figure should be read against.
CONTROL = "control"

# The floor's CPU per request (`gateway.bench.floor`, POST) on the machine the budgets were set on.
REFERENCE_FLOOR_US = 17.6

# Measures one row through a started gateway: (row, load command, its pid) → the row.
MeasureFor = Callable[[Row, MakeCmd, int], Row]


class PairCost:
    """A feature's cost from its pairs: the median difference and the spread (µs/request)."""

    __slots__ = ("median", "low", "high", "pairs")

    def __init__(self, diffs: list[float]) -> None:
        self.median = statistics.median(diffs)
        self.low, self.high = min(diffs), max(diffs)
        self.pairs = len(diffs)

    def note(self, feature: str, engine: str, budget: float, floor_us: float | None = None) -> str:
        """The cost against the budget; with the floor of the same run, the budget scaled to
        it (`scaled_budget`), the verdict then read against that."""
        limit = budget if floor_us is None else scaled_budget(budget, floor_us)
        verdict = "within" if self.median <= limit else "OVER"
        scaled = (
            ""
            if floor_us is None
            else f" at a {REFERENCE_FLOOR_US:g} µs floor = ≤ {limit:.1f} at this run's "
            f"{floor_us:.1f}"
        )
        return (
            f"{feature} in the full chain ({engine}): {self.median:+.1f} µs/req, the median of "
            f"{self.pairs} pairs (full − without it; {self.low:+.1f} … {self.high:+.1f}), "
            f"budget ≤ {budget:g}{scaled}: {verdict}"
        )

    def control_note(self, engine: str) -> str:
        """The control pair: what two copies of the same gateway differ by."""
        return (
            f"control (the full chain against a second copy of itself, {engine}): "
            f"{self.median:+.1f} µs/req, the median of {self.pairs} pairs ({self.low:+.1f} … "
            f"{self.high:+.1f}): a feature's figure within this is within the method's noise"
        )


def scaled_budget(budget_us: float, floor_us: float) -> float:
    """A feature's budget (µs on the machine where the floor costs `REFERENCE_FLOOR_US`) on a
    machine whose floor costs `floor_us` in the same run: the budgets are shares of a request's
    work, and a slower machine (or a busier host) slows the feature as it slows the floor."""
    return budget_us * floor_us / REFERENCE_FLOOR_US


def pair_cost(full_us: list[float], without_us: list[float]) -> PairCost | None:
    """The cost from the pairs' CPU per request (None: no pair was measured whole)."""
    diffs = [f - w for f, w in zip(full_us, without_us, strict=True) if f and w]
    return PairCost(diffs) if diffs else None


def feature_costs(
    s: Setup, engine: str, http_be: int, measure_for: MeasureFor, floor_us: float | None = None
) -> None:
    """A note per feature: its paired cost on `engine`, against its budget.

    Each feature's pair is two gateways started together for it, the full chain and the chain
    without the feature, so both sides are the same age: a full-chain gateway kept through all
    the features' pairs cost +0.6 and +1.0 µs/req more than a fresh copy of itself (the
    `control` pair, which measures the full chain against itself, showed it), and that offset
    was charged to every feature. `control` is the method's own spread: ask for it with
    `--features control,...`."""
    full = Variant(engine, full=True)
    asked = [f for f in str(getattr(s.args, "features", "") or "").split(",") if f]
    for feature in asked or FEATURES:
        if feature != CONTROL and feature not in FEATURES:
            known = ", ".join((*FEATURES, CONTROL))
            s.notes.append(f"{feature}: not a feature of the full chain ({known})")
            continue
        less = full if feature == CONTROL else Variant(engine, full=True, without=feature)
        started = []
        try:
            for v, name in ((full, f"pairs-{feature}-full"), (less, f"pairs-{feature}")):
                started.append(start_gateway(s, http_be, None, v, name))
        except Exception as e:
            s.notes.append(f"{feature} in the full chain ({engine}): did not start: {e}")
            for p, _ in started:
                s.procs.stop(p)
            continue
        (full_p, full_ports), (p, ports) = started
        try:
            full_cmd = s.wrk(s.url(full_ports["http"]), s.headers(full))
            less_cmd = s.wrk(s.url(ports["http"]), s.headers(less))
            with_us, without_us = [], []
            for i in range(s.args.pairs):
                # In turn full first and without first: what the first run of a pair gains or
                # loses by its place (a warmer cache, the machine's speed just then) is not
                # charged to the feature every time.
                if i % 2:
                    b = measure_for(Row(f"HTTP Sluice {less.label}"), less_cmd, p.pid)
                    a = measure_for(Row(f"HTTP Sluice {full.label}"), full_cmd, full_p.pid)
                else:
                    a = measure_for(Row(f"HTTP Sluice {full.label}"), full_cmd, full_p.pid)
                    b = measure_for(Row(f"HTTP Sluice {less.label}"), less_cmd, p.pid)
                for r in (a, b):
                    if r.error:
                        s.notes.append(f"{r.name} (pairs): {r.error}")
                with_us.append(a.cpu_us_per_req or 0.0)
                without_us.append(b.cpu_us_per_req or 0.0)
        finally:
            s.procs.stop(p)
            s.procs.stop(full_p)
        cost = pair_cost(with_us, without_us)
        if cost is None:
            s.notes.append(f"{feature} in the full chain ({engine}): no pair measured")
        elif feature == CONTROL:
            s.notes.append(cost.control_note(engine))
        else:
            s.notes.append(cost.note(feature, engine, BUDGET_US[feature], floor_us))
