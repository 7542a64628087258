"""(compiled) Tail sampling: keep or drop the trace of a finished request.

Pure: `TailSampler.decide` reads how the request ended (outcome, status, duration) and its trace
id, nothing random, so every replica decides the same for the same trace. Errors (HTTP status at
or above `error_status`, a gRPC status other than OK, any outcome but OK: exception, timeout,
upstream failure, cancellation) and refusals by Sluice (auth, limits, shedding, no route) are
always kept, so are requests slower than `slow_s`; of the rest, a trace is kept when the low 64
bits of its id fall under `ratio`·2^64 (as OpenTelemetry's TraceIdRatioBased; the threshold is
computed exactly from the decimal the policy wrote, 1e-5 → ⌊2^64/100000⌋). The outgoing
`traceparent` sampled flag is that same ratio test (`sampled`), so a backend that samples by
its parent keeps the same traces.

The kept traces wait for export in `gateway.core.pending.PendingTraces` (a generic class, so
not compiled with this module, which the trace filter calls on every request).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from gateway.core.outcome import Outcome
from gateway.core.traceparent import MASK64

ONE: Final = 1 << 64


class Reason(enum.Enum):
    """Why a trace was kept (or not); the value is the metrics label."""

    ERROR = "error"  # status ≥ error_status, gRPC status not OK, upstream failure, exception
    TIMEOUT = "timeout"  # an upstream or client deadline expired
    REJECTED = "rejected"  # refused or shed by Sluice
    SLOW = "slow"  # slower than slow_s
    LINKED = "linked"  # another request of the same trace was kept moments ago
    RATIO = "ratio"  # the trace id falls under ratio·2^64
    NOT_SAMPLED = "not_sampled"  # none of the above: dropped


@dataclass(frozen=True, slots=True)
class SampleDecision:
    keep: bool
    reason: Reason
    adjusted_count: float = 1.0  # traces this one stands for (1/ratio for a RATIO keep)


_TIMEOUTS: Final = frozenset({Outcome.UPSTREAM_TIMEOUT, Outcome.DEADLINE})
_KEEP: Final = {r: SampleDecision(True, r) for r in Reason if r is not Reason.NOT_SAMPLED}
DROP: Final = SampleDecision(False, Reason.NOT_SAMPLED)


def threshold(ratio: float) -> int:
    """ratio·2^64 as an integer, exact for the decimal written (repr of the float)."""
    if ratio <= 0:
        return 0
    return min(int(Fraction(repr(ratio)) * ONE), ONE)


class TailSampler:
    """The decision for one finished request. Built once per policy (its parameters frozen)."""

    __slots__ = ("ratio", "slow_s", "error_status", "threshold", "_ratio_keep")

    def __init__(self, ratio: float, slow_s: float, error_status: int = 400) -> None:
        self.ratio = ratio
        self.slow_s = slow_s
        self.error_status = error_status
        self.threshold = threshold(ratio)
        self._ratio_keep = SampleDecision(True, Reason.RATIO, 1.0 / ratio if ratio > 0 else 0.0)

    def sampled(self, trace_id: int) -> bool:
        """The probabilistic part alone: also the outgoing traceparent's sampled flag."""
        return (trace_id & MASK64) < self.threshold

    def decide(
        self,
        trace_id: int,
        outcome: Outcome,
        rejected: bool,
        http_status: int,
        grpc_status: int | None,
        duration_s: float,
        linked: bool = False,
    ) -> SampleDecision:
        """`rejected`: Sluice refused the request (its verdict is not ALLOW). `linked`: the
        trace is already kept (pending export)."""
        if rejected:
            return _KEEP[Reason.REJECTED]
        if outcome is not Outcome.OK:
            return _KEEP[Reason.TIMEOUT if outcome in _TIMEOUTS else Reason.ERROR]
        if http_status >= self.error_status or grpc_status:
            return _KEEP[Reason.ERROR]
        if duration_s > self.slow_s:
            return _KEEP[Reason.SLOW]
        if linked:
            return _KEEP[Reason.LINKED]
        if (trace_id & MASK64) < self.threshold:
            return self._ratio_keep
        return DROP
