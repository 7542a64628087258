"""Canary guard: p95 and error ratio of the canary against the stable version over a window;
a breach trips it for good (until a new guard)."""

from __future__ import annotations

import random

import pytest

from gateway.core.canary import BOUNDS, CanaryGuard, CanaryParams

P = CanaryParams(p95_ms=200, max_error_ratio=0.02, window_s=60, min_requests=20, eval_s=1.0)


def feed(g: CanaryGuard, now: float, canary: bool, n: int, latency: float, errors: int = 0) -> bool:
    tripped = False
    for i in range(n):
        tripped = g.record(now, canary, latency, i < errors) or tripped
    return tripped


@pytest.mark.parametrize(
    ("stable", "canary", "trips"),
    [
        ((0.05, 0), (0.05, 0), False),  # both fast, no errors
        ((0.05, 0), (0.5, 0), True),  # canary p95 500 ms > 200 ms and > stable
        ((0.6, 0), (0.5, 0), False),  # slow, but stable is slower: not the canary's fault
        ((0.05, 0), (0.05, 5), True),  # 5 % errors
        ((0.05, 10), (0.05, 5), False),  # stable has more errors
        ((0.05, 0), (0.17, 0), False),  # under the p95 bar (by more than the 10 % estimate)
    ],
)
def test_breach_rules(stable: tuple[float, int], canary: tuple[float, int], trips: bool) -> None:
    g = CanaryGuard(P)
    feed(g, 0.0, False, 100, stable[0], stable[1])
    feed(g, 0.0, True, 100, canary[0], canary[1])
    assert g.evaluate(0.5) is trips
    assert g.tripped is trips


def test_needs_min_requests_and_is_judged_without_stable_data() -> None:
    g = CanaryGuard(P)
    feed(g, 0.0, True, 19, 1.0)
    assert not g.evaluate(0.0)
    feed(g, 0.0, True, 1, 1.0)
    assert g.evaluate(0.0) and "p95" in g.reason


def test_evaluation_is_throttled_and_trips_from_record() -> None:
    g = CanaryGuard(P)
    assert not feed(g, 0.0, True, 1, 1.0)  # evaluated at t=0 with 1 request: nothing
    assert not feed(g, 0.5, True, 30, 1.0)  # next evaluation not before t=1
    assert feed(g, 1.0, True, 1, 1.0)  # now it trips
    assert not feed(g, 2.0, True, 1, 1.0)  # reports the trip once


def test_tripped_stays_tripped() -> None:
    g = CanaryGuard(P)
    feed(g, 0.0, True, 50, 1.0)
    assert g.evaluate(0.0)
    feed(g, 100.0, True, 500, 0.01)  # healthy again, long after: still tripped
    assert g.tripped and not g.evaluate(100.0)


def test_old_results_leave_the_window() -> None:
    g = CanaryGuard(P)
    feed(g, 0.0, True, 10, 1.0, errors=10)
    feed(g, 70.0, True, 50, 0.01)
    assert not g.evaluate(70.0)


def test_p95_estimate_within_ten_percent() -> None:
    rnd = random.Random(7)
    values = [rnd.lognormvariate(-2.0, 0.8) for _ in range(5000)]
    g = CanaryGuard(P)
    for v in values:
        g.record(0.0, True, v, False)
    true_p95 = sorted(values)[int(0.95 * len(values))]
    got = g.snapshot(0.0)["canary"]
    assert isinstance(got, dict)
    assert got["p95_ms"] == pytest.approx(true_p95 * 1000, rel=0.1)
    assert BOUNDS[0] == 0.001 and BOUNDS[-1] > 100
