"""Histogram buckets: conservative counts (never overstate a share) and usable quantiles."""

from __future__ import annotations

import bisect
import math
import random

import pytest

from gateway.core.histogram import (
    LAT_BOUNDS,
    LAT_BUCKETS,
    index_left,
    index_right,
    latency_between,
    latency_bucket,
    latency_lower,
    latency_upper,
    new_latency_hist,
    new_size_hist,
    quantile,
    size_between,
    size_bucket,
)


@pytest.mark.parametrize("x", [0.0, 5e-5, 1e-4, 0.0123, 0.5, 3.0, 99.0, 1e6])
def test_latency_bucket_contains_the_value(x: float) -> None:
    i = latency_bucket(x)
    assert 0 <= i < LAT_BUCKETS
    assert latency_lower(i) <= x < latency_upper(i)


def test_the_compiled_bisection_answers_as_bisect() -> None:
    """`index_left` / `index_right` replace `bisect_left` / `bisect_right` on the request path:
    the same index for every value, on the bounds themselves, just beside them, and for what
    bisect's comparisons make of NaN and the infinities, on tuples of every length up to 9 and
    with repeated bounds."""
    rng = random.Random(7)
    tuples: list[tuple[float, ...]] = [LAT_BOUNDS, (1.0, 1.0, 2.0, 2.0, 2.0, math.inf)]
    tuples += [tuple(sorted(rng.uniform(-5, 5) for _ in range(k))) for k in range(10)]
    for bounds in tuples:
        probes = [math.nan, math.inf, -math.inf, 0.0, -0.0, 0, 3, -7]
        for b in bounds:
            probes += [b, math.nextafter(b, -math.inf), math.nextafter(b, math.inf)]
        probes += [rng.uniform(-6, 6) for _ in range(200)]
        probes += [rng.uniform(0, 120) for _ in range(200)]
        for x in probes:
            assert index_left(bounds, x) == bisect.bisect_left(bounds, x), (bounds, x)
            assert index_right(bounds, x) == bisect.bisect_right(bounds, x), (bounds, x)


@pytest.mark.parametrize(("n", "bucket"), [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (1023, 10)])
def test_size_buckets_are_powers_of_two(n: int, bucket: int) -> None:
    assert size_bucket(n) == bucket


def test_size_between_counts_only_certain_sizes() -> None:
    h = new_size_hist()
    for n in (0, 1, 2, 300, 300, 5000):
        h[size_bucket(n)] += 1
    assert size_between(h, 1, 10**9) == 4  # 2, 300, 300, 5000 are all > 1 byte
    assert size_between(h, 0, 10**9) == 5  # the empty body never exceeds a limit
    assert size_between(h, 1000, 10**9) == 1
    # 300 sits in [256, 512): above 256 is certain, above 300 is not: not counted.
    assert size_between(h, 300, 10**9) == 1
    # Within the old limit: 5000 lies in [4096, 8192), not certainly <= 4096.
    assert size_between(h, 1, 4096) == 3


def test_latency_between_is_conservative() -> None:
    h = new_latency_hist()
    for x in (0.010, 0.020, 0.030, 2.0):
        h[latency_bucket(x)] += 1
    assert latency_between(h, 1e-6, 30.0) == 4
    assert latency_between(h, 1e-6, 1.0) == 3  # the 2 s one took longer than the old limit
    assert latency_between(h, 0.025, 30.0) == 2  # only buckets entirely past 25 ms


def test_quantile_is_close_to_the_truth() -> None:
    rng = random.Random(7)
    values = [rng.lognormvariate(-3, 1) for _ in range(5000)]
    h = new_latency_hist()
    for v in values:
        h[latency_bucket(v)] += 1
    true_p95 = sorted(values)[int(0.95 * len(values))]
    got = quantile(h, 0.95)
    assert got is not None
    assert true_p95 / 1.2 < got < true_p95 * 1.2
    assert quantile(new_latency_hist(), 0.95) is None
