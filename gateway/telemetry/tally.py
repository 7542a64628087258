"""(compiled) Per-request metric updates as plain numbers, added to their Prometheus children in
batches.

A Prometheus child update costs a lock and, for a histogram, a Python loop over the buckets
(~0.5 µs a counter, ~0.7 µs an observation here; a request makes four or more). The request path
instead adds to a `CountTally` / `HistTally` (an integer, or a bucket index found by
`gateway.core.histogram.index_left`), and `flush()` moves what accumulated into the
children: before every scrape of this process (`/metrics`, the status page), and every
`FLUSH_S` from the server's ticker, so a `--workers` scrape (which reads every worker's values
through the multiprocess files) is at most that far behind, and on shutdown. Exemplars are
rare (kept traces): those observations go to the child at once, so the exemplar and its count
arrive together.

The children's buckets and sum are reached through prometheus_client's `Histogram` attributes
`_upper_bounds`, `_buckets` and `_sum` (stable since 0.4; `tests/telemetry/test_tally.py` checks
the exposition against direct observations, so an upgrade that moves them fails a test).
"""

from __future__ import annotations

from typing import Any, Final

from gateway.core.histogram import index_left

FLUSH_S = 1.0

_dirty: Final[list[CountTally | HistTally]] = []


class CountTally:
    """Increments of one counter child."""

    __slots__ = ("child", "n", "queued")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.n: float = 0.0
        self.queued = False

    def inc(self, amount: float = 1) -> None:
        self.n += amount
        if not self.queued:
            self.queued = True
            _dirty.append(self)

    def flush(self) -> None:
        n, self.n = self.n, 0.0
        self.queued = False
        if n:
            self.child.inc(n)


class HistTally:
    """Observations of one histogram child: a count per bucket and the sum."""

    __slots__ = ("child", "bounds", "counts", "sum", "queued")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.bounds: tuple[float, ...] = tuple(child._upper_bounds)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.queued = False

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar:
            self.child.observe(amount, exemplar)
            return
        # The child's own rule: the first bucket whose upper bound is >= the amount.
        self.counts[index_left(self.bounds, amount)] += 1
        self.sum += amount
        if not self.queued:
            self.queued = True
            _dirty.append(self)

    def flush(self) -> None:
        counts, self.counts = self.counts, [0] * len(self.bounds)
        total, self.sum = self.sum, 0.0
        self.queued = False
        child = self.child
        for i, n in enumerate(counts):
            if n:
                child._buckets[i].inc(n)
        if total or any(counts):
            child._sum.inc(total)


def flush() -> None:
    """Move every pending update into its Prometheus child."""
    while _dirty:
        batch = _dirty[:]
        del _dirty[:]
        for t in batch:
            t.flush()
