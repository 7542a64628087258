"""(compiled) Adaptive concurrency limit of one backend pool: a latency gradient anchored to the
SLO. Pure.

Netflix's Gradient limits compare the latency to a measured no-load minimum, which must be
re-probed (Envoy pins concurrency low for whole windows to re-measure it, and drops traffic
while doing so: envoy#8337, #9007). LLM backends have a latency *target* instead, so the
gradient here is anchored to it (as ai-dynamo/dynamo#9047 proposes), with no probe at all:

    gradient = clamp(slo / smoothed latency, 0.5, 1.5)
    target   = limit · gradient
    limit   += smoothing · (target - limit)      at most every `UPDATE_S`, within [min, max]

The limit grows only while the pool actually used more than half of it since the last update
(an idle pool's latency says nothing about more load), and a sample is taken only from a
request that reached the backend (refused requests have no latency; counting them as ~0 would
inflate the limit: Netflix/concurrency-limits#176). Utilisation = in flight / limit is the
pool's overload signal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

UPDATE_S: Final = 0.1
EMA_ALPHA: Final = 0.2  # weight of one latency sample in the smoothed latency


@dataclass(frozen=True, slots=True)
class LimitParams:
    slo_s: float = 0.5
    initial: int = 64
    min_limit: int = 4
    max_limit: int = 1000
    smoothing: float = 0.2


class GradientLimit:
    __slots__ = ("p", "limit", "in_flight", "latency", "peak", "updated", "samples")

    def __init__(self, p: LimitParams, now: float = 0.0) -> None:
        self.p = p
        self.limit = float(p.initial)
        self.in_flight = 0
        self.latency = 0.0  # smoothed latency sample (s); 0 until the first one
        self.peak = 0  # highest in flight since the last update
        self.updated = now
        self.samples = 0

    @property
    def utilisation(self) -> float:
        return self.in_flight / self.limit

    def start(self) -> None:
        self.in_flight += 1
        if self.in_flight > self.peak:
            self.peak = self.in_flight

    def finish(self, latency: float | None, now: float) -> None:
        """A request left the pool; `latency` (s) when it reached the backend, else None."""
        if self.in_flight > 0:
            self.in_flight -= 1
        if latency is None or latency < 0.0:
            return
        self.latency = (
            latency if self.samples == 0 else (self.latency + EMA_ALPHA * (latency - self.latency))
        )
        self.samples += 1
        if now - self.updated >= UPDATE_S:
            self._update(now)

    def _update(self, now: float) -> None:
        p = self.p
        gradient = p.slo_s / self.latency if self.latency > 0.0 else 1.5
        gradient = 0.5 if gradient < 0.5 else (1.5 if gradient > 1.5 else gradient)
        if gradient > 1.0 and self.peak * 2 < self.limit:
            gradient = 1.0  # not using the limit: no evidence that more would be fine
        target = self.limit * gradient
        limit = self.limit + p.smoothing * (target - self.limit)
        self.limit = float(min(p.max_limit, max(p.min_limit, limit)))
        self.updated = now
        self.peak = self.in_flight
