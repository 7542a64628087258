"""Sliding window counters and the health-check thresholds."""

from __future__ import annotations

import pytest

from gateway.core.health import HealthParams, HealthState
from gateway.core.window import SlidingCounts


def test_window_sums_and_slides_bucket_by_bucket() -> None:
    w = SlidingCounts(10.0, 2, buckets=10)
    w.add(0.0, 0)
    w.add(0.5, 1, 3)
    w.add(5.0, 0)
    assert w.totals(5.0) == [2, 3]
    assert w.totals(9.99) == [2, 3]
    assert w.totals(10.0) == [1, 0]  # the first bucket [0, 1) left
    assert w.totals(15.0) == [0, 0]
    w.add(100.0, 0)
    assert w.totals(100.0) == [1, 0]


def test_window_late_sample_counts_as_newest() -> None:
    w = SlidingCounts(10.0, 1)
    w.add(50.0, 0)
    w.add(1.0, 0)  # far in the past: counted in the newest bucket, never lost
    assert w.totals(50.0) == [2]


def test_window_clear() -> None:
    w = SlidingCounts(1.0, 1)
    w.add(0.0, 0)
    w.clear()
    assert w.totals(0.0) == [0]


@pytest.mark.parametrize(
    ("results", "healthy"),
    [
        ("ff", True),
        ("fff", False),
        ("fffp", False),
        ("fffpp", True),
        ("fpfpfp", True),  # never 3 failures in a row
        ("fffpfpp", True),
    ],
)
def test_health_thresholds(results: str, healthy: bool) -> None:
    h = HealthState(HealthParams(unhealthy_after=3, healthy_after=2))
    for r in results:
        h.observe(r == "p", "boom")
    assert h.healthy is healthy


def test_health_checks_faster_while_failing_with_jitter() -> None:
    h = HealthState(HealthParams(interval_s=30, failing_interval_s=2, jitter=0.1))
    assert h.next_delay(0.5) == 30.0
    assert h.next_delay(0.0) == pytest.approx(27.0)
    assert h.next_delay(0.999) == pytest.approx(32.994)
    h.observe(False, "timeout")
    assert h.failing and h.next_delay(0.5) == 2.0
    assert h.observe(True) is False and not h.failing and h.next_delay(0.5) == 30.0
