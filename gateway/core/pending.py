"""The bounded buffer of kept traces waiting for export (`gateway.core.sampler` decides which).

Pure. `PendingTraces` holds the kept traces between the decision and their export, keyed by
trace id, oldest first, so that a later request of a kept trace (a client's retry after an
error) joins it for `max_wait` (`Reason.LINKED`). It is bounded: at most `max_traces` traces
(when full, the oldest is dropped and counted) and `max_spans` spans per trace (spans beyond
are dropped and counted). `ids` is the map by trace id itself (the same object for the
buffer's life), for the trace filter's `trace_id in ids` without a Python-level call.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class _Entry(Generic[T]):
    __slots__ = ("first", "spans", "items")

    def __init__(self, first: float) -> None:
        self.first = first
        self.spans = 0
        self.items: list[T] = []


class PendingTraces(Generic[T]):
    """Kept traces waiting for export (see the module docstring). `T` is whatever the caller
    keeps per request; `offer` says how many spans it will make."""

    __slots__ = ("max_traces", "max_spans", "max_wait", "ids", "dropped_traces",
                 "dropped_spans", "spans")  # fmt: skip

    def __init__(self, max_traces: int, max_spans: int, max_wait: float) -> None:
        self.max_traces = max_traces
        self.max_spans = max_spans
        self.max_wait = max_wait
        self.ids: OrderedDict[int, _Entry[T]] = OrderedDict()
        self.dropped_traces = 0  # evicted before export: the buffer was full
        self.dropped_spans = 0  # refused: the trace had max_spans already
        self.spans = 0  # spans held now

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, trace_id: int) -> bool:
        return trace_id in self.ids

    def offer(self, trace_id: int, item: T, spans: int, now: float) -> bool:
        """Hold `item` (making `spans` spans) under its trace; False if it was refused."""
        entry = self.ids.get(trace_id)
        if entry is None:
            while len(self.ids) >= self.max_traces:
                self._evict_oldest()
            entry = self.ids[trace_id] = _Entry(now)
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
        traces = self.ids
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
        out = [(t, e.items) for t, e in self.ids.items()]
        self.ids.clear()
        self.spans = 0
        return out

    def resize(self, max_traces: int, max_spans: int, max_wait: float) -> None:
        """New bounds (a policy reload): the oldest traces beyond `max_traces` are dropped."""
        self.max_traces, self.max_spans, self.max_wait = max_traces, max_spans, max_wait
        while len(self.ids) > max_traces:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, old = self.ids.popitem(last=False)
        self.spans -= old.spans
        self.dropped_traces += 1
