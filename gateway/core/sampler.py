"""Tail sampling: keep or drop the trace of a finished request, and the bounded buffer of the kept.

Pure: `TailSampler.decide` reads how the request ended (outcome, status, duration) and its trace
id, nothing random, so every replica decides the same for the same trace. Errors (HTTP status at
or above `error_status`, a gRPC status other than OK, any outcome but OK: exception, timeout,
upstream failure, cancellation) and refusals by Sluice (auth, limits, shedding, no route) are
always kept, so are requests slower than `slow_s`; of the rest, a trace is kept when the low 64
bits of its id fall under `ratio`·2^64 (as OpenTelemetry's TraceIdRatioBased; the threshold is
computed exactly from the decimal the policy wrote, 1e-5 → ⌊2^64/100000⌋). The outgoing
`traceparent` sampled flag is that same ratio test (`sampled`), so a backend that samples by
its parent keeps the same traces.

`PendingTraces` holds the kept traces between the decision and their export, keyed by trace
id, oldest first, so that a later request of a kept trace (a client's retry after an error)
joins it for `max_wait` (`Reason.LINKED`). It is bounded: at most `max_traces` traces (when
full, the oldest is dropped and counted) and `max_spans` spans per trace (spans beyond are
dropped and counted).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from typing import Generic, TypeVar

from gateway.core.outcome import Outcome
from gateway.core.traceparent import MASK64

T = TypeVar("T")

ONE = 1 << 64


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


_TIMEOUTS = frozenset({Outcome.UPSTREAM_TIMEOUT, Outcome.DEADLINE})
_KEEP = {r: SampleDecision(True, r) for r in Reason if r is not Reason.NOT_SAMPLED}
DROP = SampleDecision(False, Reason.NOT_SAMPLED)


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


class _Entry(Generic[T]):
    __slots__ = ("first", "spans", "items")

    def __init__(self, first: float) -> None:
        self.first = first
        self.spans = 0
        self.items: list[T] = []


class PendingTraces(Generic[T]):
    """Kept traces waiting for export (see the module docstring). `T` is whatever the caller
    keeps per request; `offer` says how many spans it will make."""

    __slots__ = ("max_traces", "max_spans", "max_wait", "_traces", "dropped_traces",
                 "dropped_spans", "spans")  # fmt: skip

    def __init__(self, max_traces: int, max_spans: int, max_wait: float) -> None:
        self.max_traces = max_traces
        self.max_spans = max_spans
        self.max_wait = max_wait
        self._traces: OrderedDict[int, _Entry[T]] = OrderedDict()
        self.dropped_traces = 0  # evicted before export: the buffer was full
        self.dropped_spans = 0  # refused: the trace had max_spans already
        self.spans = 0  # spans held now

    def __len__(self) -> int:
        return len(self._traces)

    def __contains__(self, trace_id: int) -> bool:
        return trace_id in self._traces

    def offer(self, trace_id: int, item: T, spans: int, now: float) -> bool:
        """Hold `item` (making `spans` spans) under its trace; False if it was refused."""
        entry = self._traces.get(trace_id)
        if entry is None:
            while len(self._traces) >= self.max_traces:
                self._evict_oldest()
            entry = self._traces[trace_id] = _Entry(now)
        if entry.spans + spans > self.max_spans:
            self.dropped_spans += spans
            return False
        entry.spans += spans
        entry.items.append(item)
        self.spans += spans
        return True

    def due(self, now: float) -> list[tuple[int, list[T]]]:
        """Remove and return the traces held `max_wait` or longer, oldest first."""
        out: list[tuple[int, list[T]]] = []
        traces = self._traces
        while traces:
            trace_id, entry = next(iter(traces.items()))
            if now - entry.first < self.max_wait:
                break
            del traces[trace_id]
            self.spans -= entry.spans
            out.append((trace_id, entry.items))
        return out

    def drain(self) -> list[tuple[int, list[T]]]:
        """Remove and return every trace (at stop), oldest first."""
        out = [(t, e.items) for t, e in self._traces.items()]
        self._traces.clear()
        self.spans = 0
        return out

    def resize(self, max_traces: int, max_spans: int, max_wait: float) -> None:
        """New bounds (a policy reload): the oldest traces beyond `max_traces` are dropped."""
        self.max_traces, self.max_spans, self.max_wait = max_traces, max_spans, max_wait
        while len(self._traces) > max_traces:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, old = self._traces.popitem(last=False)
        self.spans -= old.spans
        self.dropped_traces += 1
