"""(compiled) Outlier ejection of one backend member: too many timeouts over a long window takes it
out.

Pure: callers pass `now`. A member whose timeout share over `window_s` (golden default: 2 min)
exceeds `timeout_ratio` (15 %), with at least `min_requests` results in the window, asks to be
ejected; the backend's pool grants it only while the ejected share stays within `max_ejected`
(always at least one member, as Envoy does), so a fleet-wide slowdown cannot empty a pool.
An ejection lasts `ejection_s` times the number of times the member has been ejected (capped at
`max_ejection_s`); when it ends the member's window starts afresh. The breaker opening is the
other way out of rotation; it is counted on its own (the pool reports both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.core.window import SlidingCounts


@dataclass(frozen=True, slots=True)
class OutlierParams:
    timeout_ratio: float = 0.15
    window_s: float = 120.0
    min_requests: int = 20
    max_ejected: float = 0.1
    ejection_s: float = 30.0
    max_ejection_s: float = 300.0


def max_ejected(params: OutlierParams, members: int) -> int:
    """How many of `members` may be ejected at once: the share, rounded down, at least one."""
    return max(1, math.floor(params.max_ejected * members + 1e-9)) if members else 0


class Outlier:
    __slots__ = ("p", "window", "ejected_until", "ejections", "last_ratio")

    def __init__(self, params: OutlierParams) -> None:
        self.p = params
        self.window = SlidingCounts(params.window_s, 2)  # results, timeouts
        self.ejected_until = 0.0
        self.ejections = 0  # times ejected since creation (multiplies the ejection time)
        self.last_ratio = 0.0

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def record(self, now: float, timed_out: bool) -> bool:
        """Count one result; True when the member now qualifies for ejection."""
        w = self.window
        row = w.advance(now)
        row[0] += 1
        w.sums[0] += 1
        if not timed_out:
            return False
        row[1] += 1
        w.sums[1] += 1
        n, t = w.sums
        if n < self.p.min_requests or now < self.ejected_until:
            return False
        self.last_ratio = t / n
        return self.last_ratio > self.p.timeout_ratio

    def eject(self, now: float) -> float:
        """Take the member out; returns until when."""
        self.ejections += 1
        length = min(self.p.max_ejection_s, self.p.ejection_s * self.ejections)
        self.ejected_until = now + length
        self.window.clear()
        return self.ejected_until

    def next_deadline(self, now: float) -> float:
        return self.ejected_until if now < self.ejected_until else math.inf

    def snapshot(self, now: float) -> dict[str, object]:
        n, t = self.window.totals(now)
        out: dict[str, object] = {
            "window": {"requests": n, "timeouts": t},
            "ejections": self.ejections,
        }
        if self.ejected(now):
            out["ejected_for_s"] = round(self.ejected_until - now, 3)
        return out
