"""(compiled) Pressure: the two limiter signals folded into one admission score. Pure.

pressure = w_q · QPS utilisation + w_t · token utilisation (golden weights 0.6 / 0.4), and a
request is admitted while pressure < `admit_below` (0.95: a 5 % buffer). A rule with only one
of the two limits has one signal; its weight is then the whole score (so a QPS-only rule admits
up to 95 % of its qps). The score never replaces the hard limits: a full window and an empty
token bucket refuse on their own, whatever the weighted sum says.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Weights:
    """Normalised weights for the signals a rule has (they sum to 1)."""

    q: float
    t: float

    @classmethod
    def of(cls, wq: float, wt: float, has_q: bool, has_t: bool) -> Weights:
        if has_q and not has_t:
            return cls(1.0, 0.0)
        if has_t and not has_q:
            return cls(0.0, 1.0)
        total = wq + wt
        return cls(wq / total, wt / total)


def pressure(q: float, t: float, w: Weights) -> float:
    return w.q * q + w.t * t
