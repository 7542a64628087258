"""(compiled) Canary guard: compare a canary's p95 latency and error ratio with the stable version's
over a sliding window; on a breach the canary's weight goes to 0 and stays there.

Pure: callers pass `now`. Each finished request of the route is recorded with its latency (time
to first byte: a stream is judged by how soon it starts, not by how long it runs) and whether
the backend failed it. Every `eval_s` the guard looks at the window (`window_s`); once the canary
has `min_requests` results there it breaches when either

- its p95 latency is above `p95_ms` and above the stable version's p95, or
- its error ratio is above `max_error_ratio` and above the stable version's ratio.

Judging against the stable version too keeps a fleet-wide slowdown (stable as slow as the canary)
from being blamed on the canary. A tripped guard never resets itself: only a new guard (a policy
change to the route's canary or weights) brings the canary back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gateway.core.histogram import index_left
from gateway.core.window import SlidingCounts

# Latency bucket upper bounds (seconds): 1 ms to ~2 min, 10 % apart; p95 is interpolated inside
# the bucket it falls in (off by less than 10 %).
BOUNDS: Final[tuple[float, ...]] = tuple(0.001 * 1.1**i for i in range(124))
_OFFSET: Final = 2  # row layout: requests, errors, then one counter per bucket (+1 overflow)


@dataclass(frozen=True, slots=True)
class CanaryParams:
    p95_ms: float = 200.0
    max_error_ratio: float = 0.02
    window_s: float = 60.0
    min_requests: int = 20
    eval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class VersionStats:
    requests: int
    errors: int
    p95_s: float | None  # None: no request in the window

    @property
    def error_ratio(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def _stats(counts: SlidingCounts, now: float) -> VersionStats:
    sums = counts.totals(now)
    n = sums[0]
    if not n:
        return VersionStats(0, 0, None)
    rank = 0.95 * n
    seen = 0
    for i in range(len(BOUNDS)):
        here = sums[_OFFSET + i]
        if seen + here >= rank:
            low = BOUNDS[i - 1] if i else 0.0
            return VersionStats(n, sums[1], low + (BOUNDS[i] - low) * (rank - seen) / here)
        seen += here
    return VersionStats(n, sums[1], BOUNDS[-1])  # beyond the last bound: report the bound


class CanaryGuard:
    __slots__ = ("p", "_stable", "_canary", "_next_eval", "tripped", "reason", "tripped_at")

    def __init__(self, params: CanaryParams) -> None:
        self.p = params
        width = _OFFSET + len(BOUNDS) + 1
        self._stable = SlidingCounts(params.window_s, width)
        self._canary = SlidingCounts(params.window_s, width)
        self._next_eval = 0.0
        self.tripped = False
        self.reason = ""
        self.tripped_at: float | None = None

    def record(self, now: float, canary: bool, latency_s: float, failed: bool) -> bool:
        """Count one finished request; True when this call tripped the guard."""
        counts = self._canary if canary else self._stable
        row = counts.advance(now)
        sums = counts.sums
        k = _OFFSET + index_left(BOUNDS, latency_s)
        row[0] += 1
        sums[0] += 1
        row[k] += 1
        sums[k] += 1
        if failed:
            row[1] += 1
            sums[1] += 1
        if self.tripped or now < self._next_eval:
            return False
        self._next_eval = now + self.p.eval_s
        return self.evaluate(now)

    def evaluate(self, now: float) -> bool:
        """Judge the window now; True when this call tripped the guard."""
        if self.tripped:
            return False
        c = _stats(self._canary, now)
        if c.requests < self.p.min_requests:
            return False
        s = _stats(self._stable, now)
        judged = s.requests >= self.p.min_requests
        limit = self.p.p95_ms / 1000.0
        assert c.p95_s is not None
        if c.p95_s > limit and (not judged or s.p95_s is None or c.p95_s > s.p95_s):
            stable = f", stable {s.p95_s * 1000:.0f} ms" if judged and s.p95_s else ""
            return self._trip(now, f"p95 {c.p95_s * 1000:.0f} ms > {self.p.p95_ms:g} ms{stable}")
        if c.error_ratio > self.p.max_error_ratio and (not judged or c.error_ratio > s.error_ratio):
            stable = f", stable {s.error_ratio:.3f}" if judged else ""
            return self._trip(
                now, f"error ratio {c.error_ratio:.3f} > {self.p.max_error_ratio:g}{stable}"
            )
        return False

    def _trip(self, now: float, reason: str) -> bool:
        self.tripped = True
        self.reason = reason
        self.tripped_at = now
        return True

    def snapshot(self, now: float) -> dict[str, object]:
        def one(v: VersionStats) -> dict[str, object]:
            p95 = None if v.p95_s is None else round(v.p95_s * 1000, 1)
            return {"requests": v.requests, "error_ratio": round(v.error_ratio, 4), "p95_ms": p95}

        return {
            "tripped": self.tripped,
            "reason": self.reason,
            "canary": one(_stats(self._canary, now)),
            "stable": one(_stats(self._stable, now)),
        }
