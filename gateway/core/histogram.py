"""(compiled) Fixed-bucket histograms for latencies and sizes: a list increment per observation,
quantiles and "how many in a range" read back at decision time. Pure, stdlib only.

Latency buckets grow by √2 from 100 µs to ~105 s (41 buckets): a p95 read from them is within
a factor 1.19 of the true value after the log interpolation `quantile` does. Size buckets are
powers of two (`int.bit_length()`), 0 bytes to 4 GiB.

Both kinds count the observations *certainly* inside a range (`latency_between`, `size_between`):
only buckets that lie wholly inside it count, so the change guard built on them never overstates
a share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

LAT_BOUNDS: Final[tuple[float, ...]] = tuple(1e-4 * math.sqrt(2) ** k for k in range(41))
LAT_BUCKETS: Final = len(LAT_BOUNDS) + 1  # bucket 0: [0, 100 µs); the last: ≥ LAT_BOUNDS[-1]
SIZE_BUCKETS: Final = 34  # bucket i: [2**(i-1), 2**i) bytes; bucket 0: empty bodies


def index_right(bounds: tuple[float, ...], x: float) -> int:
    """`bisect.bisect_right(bounds, x)` (the first index whose bound is > x), searched in
    compiled code: the bounds unboxed, no argument parsing. bisect's own comparisons, so a NaN
    lands where bisect puts it. A third of bisect's instructions a call from compiled code (a
    request makes five)."""
    lo, hi = 0, len(bounds)
    while lo < hi:
        mid = (lo + hi) >> 1
        if x < bounds[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def index_left(bounds: tuple[float, ...], x: float) -> int:
    """`bisect.bisect_left(bounds, x)` (the first index whose bound is >= x), as `index_right`."""
    lo, hi = 0, len(bounds)
    while lo < hi:
        mid = (lo + hi) >> 1
        if bounds[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def latency_bucket(seconds: float) -> int:
    return index_right(LAT_BOUNDS, seconds)


def size_bucket(n: int) -> int:
    return min(n.bit_length(), SIZE_BUCKETS - 1)


def latency_lower(i: int) -> float:
    return 0.0 if i == 0 else LAT_BOUNDS[i - 1]


def latency_upper(i: int) -> float:
    return LAT_BOUNDS[i] if i < len(LAT_BOUNDS) else math.inf


def size_lower(i: int) -> int:
    return 0 if i == 0 else 1 << (i - 1)


def new_latency_hist() -> list[int]:
    return [0] * LAT_BUCKETS


def new_size_hist() -> list[int]:
    return [0] * SIZE_BUCKETS


def merge(into: list[int], other: Sequence[int]) -> None:
    for i, n in enumerate(other):
        if n:
            into[i] += n


def size_between(hist: Sequence[int], above: int, at_most: int) -> int:
    """Observations certainly > `above` and certainly ≤ `at_most` bytes (bucket i holds sizes
    up to 2**i - 1)."""
    return sum(
        (n for i, n in enumerate(hist) if n and size_lower(i) > above and (1 << i) - 1 <= at_most),
        0,
    )


def latency_between(hist: Sequence[int], at_least: float, below: float) -> int:
    """Observations certainly ≥ `at_least` and certainly < `below` seconds."""
    return sum(
        (
            n
            for i, n in enumerate(hist)
            if n and latency_lower(i) >= at_least and latency_upper(i) <= below
        ),
        0,
    )


def quantile(hist: Sequence[int], q: float) -> float | None:
    """The q-quantile (0 < q ≤ 1) of a latency histogram, log-interpolated inside its bucket;
    None when empty. The open last bucket reports its lower bound."""
    total = sum(hist, 0)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(hist):
        if not n:
            continue
        if seen + n >= rank:
            lo, hi = latency_lower(i), latency_upper(i)
            if math.isinf(hi):
                return lo
            frac = (rank - seen) / n
            if lo == 0.0:
                return hi * frac
            return float(lo * (hi / lo) ** frac)
        seen += n
    return latency_lower(len(hist) - 1)
