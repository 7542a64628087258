"""(compiled) Sliding-window counters over time: a ring of time buckets, running sums, O(1) per
record.

Pure: callers pass `now` (seconds, any monotonic origin). A window of `window_s` is split into
`buckets` buckets; a bucket older than the window is dropped whole, so the window slides in steps
of `window_s / buckets` (10 % by default), as Hystrix's rolling counters do.
"""

from __future__ import annotations


class SlidingCounts:
    """`width` counters summed over the last `window_s` seconds (`sums[k]` is counter k)."""

    __slots__ = ("_span", "_n", "_width", "_ring", "_ids", "_head", "sums")

    def __init__(self, window_s: float, width: int, buckets: int = 10) -> None:
        self._span = window_s / buckets  # seconds per bucket
        self._n = buckets
        self._width = width
        self._ring = [[0] * width for _ in range(buckets)]
        self._ids = [-1] * buckets  # absolute bucket number each slot holds
        self._head = -1  # newest absolute bucket number seen
        self.sums = [0] * width

    def advance(self, now: float) -> list[int]:
        """The row of the bucket `now` falls in (expired buckets cleared first). A caller that
        adds to the row adds the same to `sums` (the breaker and outlier records count
        several columns at once this way)."""
        b = int(now // self._span)
        if b == self._head:
            return self._ring[b % self._n]
        slot = b % self._n
        if b != self._head:
            if b > self._head:
                # Drop every slot the window left behind between the old head and `b`.
                start = max(self._head + 1, b - self._n + 1)
                for old in range(start, b + 1):
                    s = old % self._n
                    if self._ids[s] != old:
                        row = self._ring[s]
                        if self._ids[s] >= 0:
                            sums = self.sums
                            for k in range(self._width):
                                sums[k] -= row[k]
                        for k in range(self._width):
                            row[k] = 0
                        self._ids[s] = old
                self._head = b
            elif self._ids[slot] != b:  # a late `now` outside the window: count it as newest
                slot = self._head % self._n
        return self._ring[slot]

    def add(self, now: float, k: int, amount: int = 1) -> None:
        self.advance(now)[k] += amount
        self.sums[k] += amount

    def totals(self, now: float) -> list[int]:
        """The sums over the window that ends at `now` (expired buckets dropped first)."""
        self.advance(now)
        return self.sums

    def clear(self) -> None:
        for row in self._ring:
            for k in range(self._width):
                row[k] = 0
        self._ids = [-1] * self._n
        self._head = -1
        self.sums = [0] * self._width
