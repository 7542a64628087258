"""Sliding window and token bucket arithmetic, with a manual clock (times are plain floats)."""

from __future__ import annotations

import math

import pytest

from gateway.core.limiter import Bucket, Window, utilisation


def admitted_after(hits: list[float], at: float, size: float = 1.0) -> float:
    w = Window(size)
    for t in hits:
        w.admit(t)
    return w.admitted(at)


@pytest.mark.parametrize(
    ("hits", "at", "expected"),
    [
        ([], 0.5, 0.0),
        ([10.1, 10.2, 10.3], 10.5, 3.0),  # same fixed window
        ([10.1, 10.2, 10.3, 10.4], 11.25, 3.0),  # previous window weighted by 0.75
        ([10.1, 10.2, 10.3, 10.4], 11.5, 2.0),
        ([10.1, 10.2, 10.3, 10.4, 11.1], 11.5, 3.0),
        ([10.1, 10.2], 12.5, 0.0),  # idle for more than a window: forgotten
        ([10.5] * 10, 11.0, 10.0),  # at the boundary the whole previous window counts
    ],
)
def test_window_estimate(hits: list[float], at: float, expected: float) -> None:
    assert admitted_after(hits, at) == pytest.approx(expected)


def test_window_counts_offered_and_admitted_apart() -> None:
    w = Window(1.0)
    for _ in range(5):
        w.offer(3.1)
    w.admit(3.1, 2)
    assert w.offered(3.5) == 5 and w.admitted(3.5) == 2


def test_window_unadmit_borrows_from_the_previous_window() -> None:
    w = Window(1.0)
    w.admit(1.5, 3)
    w.admitted(2.0)  # roll: 3 now in the previous window, 0 in the current
    w.unadmit(2)
    assert w.cur == 0 and w.prev == 1


@pytest.mark.parametrize(
    ("hits", "now", "limit", "expected"),
    [
        ([], 5.0, 3, 0.0),  # fits
        ([5.1, 5.2], 5.5, 3, 0.0),
        ([5.1, 5.2, 5.3], 5.5, 3, 0.5 + 1 / 3),  # next window, until 3 * (1 - f) <= 2
        ([4.1, 4.2, 4.3, 4.4], 5.0, 4, 0.25),  # previous window decays at 4/s; needs 1 less
    ],
)
def test_window_retry_after(hits: list[float], now: float, limit: float, expected: float) -> None:
    w = Window(1.0)
    for t in hits:
        w.admit(t)
    ra = w.retry_after(now, limit)
    assert ra == pytest.approx(expected, abs=1e-9)
    if ra:  # and one more request does fit after that long
        w2 = Window(1.0)
        for t in hits:
            w2.admit(t)
        assert w2.admitted(now + ra + 1e-6) + 1 <= limit + 1e-6


@pytest.mark.parametrize(
    ("tokens", "rate", "burst", "dt", "expected"),
    [
        (0.0, 10.0, 100.0, 1.0, 10.0),
        (95.0, 10.0, 100.0, 1.0, 100.0),  # capped at burst
        (-50.0, 10.0, 100.0, 2.0, -30.0),  # a debt is repaid by the refill
        (10.0, 10.0, 100.0, 0.0, 10.0),
        (10.0, 10.0, 100.0, -5.0, 10.0),  # time going back does not drain
    ],
)
def test_bucket_refill(
    tokens: float, rate: float, burst: float, dt: float, expected: float
) -> None:
    b = Bucket(tokens, 100.0)
    assert b.level(rate, burst, 100.0 + dt) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("start", "add", "expected"),
    [(50.0, 20.0, 70.0), (90.0, 20.0, 100.0), (10.0, -60.0, -50.0), (-80.0, -60.0, -100.0)],
)
def test_bucket_add_stays_within_plus_minus_burst(
    start: float, add: float, expected: float
) -> None:
    b = Bucket(start, 0.0)
    b.add(add, 100.0)
    assert b.tokens == expected


@pytest.mark.parametrize(("start", "expected"), [(-40.0, 0.0), (0.0, 0.0), (30.0, 30.0)])
def test_forgive_writes_off_debt_only(start: float, expected: float) -> None:
    b = Bucket(start, 0.0)
    b.forgive()
    assert b.tokens == expected


@pytest.mark.parametrize(
    ("tokens", "rate", "expected"),
    [(5.0, 10.0, 0.0), (0.0, 10.0, 1e-10), (-20.0, 10.0, 2.0), (-1.0, 0.0, math.inf)],
)
def test_bucket_retry_after(tokens: float, rate: float, expected: float) -> None:
    assert Bucket(tokens, 0.0).retry_after(rate, 100.0, 0.0) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    ("tokens", "burst", "expected"),
    [(100.0, 100.0, 0.0), (0.0, 100.0, 1.0), (25.0, 100.0, 0.75), (-50.0, 100.0, 1.5)],
)
def test_token_utilisation_is_one_minus_available_over_capacity(
    tokens: float, burst: float, expected: float
) -> None:
    assert utilisation(tokens, burst) == expected


def test_bucket_take_is_level_then_add() -> None:
    """`take` (one call for a reservation) does exactly what `level` and `add(-n)` do."""
    import random

    rng = random.Random(7)
    a, b = Bucket(10.0, 0.0), Bucket(10.0, 0.0)
    now = 0.0
    for _ in range(2000):
        now += rng.choice([0.0, -0.01, rng.random() * 0.5])  # time may stand or step back
        n = rng.choice([1.0, 5.0, 30.0, rng.random() * 40])
        took = a.take(4.0, 10.0, now, n)
        expected = b.level(4.0, 10.0, now) > 0.0
        if expected:
            b.add(-n, 10.0)
        assert took is expected
        assert (a.tokens, a.updated) == (b.tokens, b.updated)
