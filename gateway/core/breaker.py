"""(compiled) Circuit breaker of one backend member: closed / open / half-open as a transition
table.

Pure: every method takes `now`; jitter comes from an injected `random() -> float in [0, 1)`.

- CLOSED admits everything and records each result in a sliding window (`window_s`). It trips
  (TRIPPED → OPEN) on `consecutive_failures` failures in a row, or, once the window holds at least
  `min_requests` results, when the failed share reaches `error_ratio` or the slow share (time to
  first byte above `slow_call_s`; a stream is judged by its first byte, not its length) reaches
  `slow_ratio`.
- OPEN admits nothing for the open time: `open_s`, doubled at each re-open without a close in
  between, capped at `max_open_s`, ±20 % jitter (so a fleet of gateways does not probe in step).
  When it has passed (COOLDOWN_ELAPSED → HALF_OPEN).
- HALF_OPEN admits at most `half_open_probes` probes in total. All of them succeeding (not slow)
  closes it (PROBE_OK → CLOSED, fresh window); any probe failing, slow, or with no answer within
  `probe_timeout_s` re-opens it (PROBE_FAILED → OPEN). A probe that hangs is therefore judged by
  `tick` at its deadline: a breaker is never stuck half-open.

Results carry the ticket `allow` returned: a result from an earlier state (a request admitted
before the breaker tripped, a probe already judged as hung) changes nothing. A result that is
neither success nor failure (the client went away) only frees its probe slot.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from gateway.core.window import SlidingCounts


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Event(enum.Enum):
    TRIPPED = "tripped"
    COOLDOWN_ELAPSED = "cooldown_elapsed"
    PROBE_OK = "probe_ok"
    PROBE_FAILED = "probe_failed"


# Pairs not listed leave the state unchanged.
TRANSITIONS: Final[dict[tuple[State, Event], State]] = {
    (State.CLOSED, Event.TRIPPED): State.OPEN,
    (State.OPEN, Event.COOLDOWN_ELAPSED): State.HALF_OPEN,
    (State.HALF_OPEN, Event.PROBE_OK): State.CLOSED,
    (State.HALF_OPEN, Event.PROBE_FAILED): State.OPEN,
}

JITTER: Final = 0.2  # open time is scaled by a factor in [1 - JITTER, 1 + JITTER)
REFUSED: Final = -1  # the ticket `allow` returns when the breaker admits nothing
_PROBE_BITS: Final = 8  # ticket = epoch << 8 | probe number (0 = not a probe)
MAX_PROBES: Final = (1 << _PROBE_BITS) - 1


@dataclass(frozen=True, slots=True)
class BreakerParams:
    consecutive_failures: int = 5  # 0 = off
    error_ratio: float = 0.5  # > 1 = off
    slow_call_s: float = 10.0
    slow_ratio: float = 0.5  # > 1 = off
    min_requests: int = 20
    window_s: float = 10.0
    open_s: float = 5.0
    max_open_s: float = 60.0
    half_open_probes: int = 3
    probe_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 1 <= self.half_open_probes <= MAX_PROBES:
            raise ValueError(f"half_open_probes must be 1..{MAX_PROBES}")


@dataclass(frozen=True, slots=True)
class Change:
    """A transition that happened: for the log line, the metric and the member's plan."""

    old: State
    new: State
    event: Event
    reason: str  # e.g. "5 consecutive failures", "error ratio 0.62 over 24 requests"


class Breaker:
    __slots__ = (
        "p", "state", "epoch", "open_until", "reopens", "consecutive", "window",
        "probes_started", "probes_ok", "probe_started", "probe_open", "_random", "last_change",
    )  # fmt: skip

    def __init__(self, params: BreakerParams, random: Callable[[], float]) -> None:
        self.p = params
        self._random = random
        self.state = State.CLOSED
        self.epoch = 0  # bumped at every transition; tickets of older epochs are stale
        self.open_until = 0.0
        self.reopens = 0  # opens since the last close: the exponent of the back-off
        self.consecutive = 0
        self.window = SlidingCounts(params.window_s, 3)  # requests, failures, slow
        self.probes_started = 0  # probes admitted in this half-open period (freed ones excluded)
        self.probes_ok = 0
        self.probe_started: list[float] = []  # start time per probe number - 1
        self.probe_open: list[bool] = []  # probe still awaiting its result
        self.last_change: Change | None = None

    # --- admission ---------------------------------------------------------------------------
    def allow(self, now: float) -> int:
        """A ticket to pass to `record`, or REFUSED. Moves OPEN → HALF_OPEN when due."""
        if self.state is State.CLOSED:
            return self.epoch << _PROBE_BITS
        if self.state is State.OPEN:
            if now < self.open_until:
                return REFUSED
            self._fire(Event.COOLDOWN_ELAPSED, now, "open time elapsed")
        return self._probe(now)

    def _probe(self, now: float) -> int:
        self._expire_probes(now)
        if not self._probe_free():
            return REFUSED
        self.probes_started += 1
        self.probe_started.append(now)
        self.probe_open.append(True)
        return self.epoch << _PROBE_BITS | len(self.probe_open)

    def _probe_free(self) -> bool:
        return (
            self.state is State.HALF_OPEN
            and self.probes_started < self.p.half_open_probes
            and len(self.probe_open) < MAX_PROBES
        )

    def admits(self, now: float) -> bool:
        """Would `allow` admit a request now? (No side effect but the due transitions.)"""
        self.tick(now)
        return self.state is State.CLOSED or self._probe_free()

    # --- results -----------------------------------------------------------------------------
    def record(self, ticket: int, now: float, failed: bool, slow: bool) -> Change | None:
        """One request's result. `failed`: the backend is to blame; `slow`: first byte later
        than `slow_call_s`. Returns the transition it caused, if any."""
        if ticket < 0 or ticket >> _PROBE_BITS != self.epoch:
            return None  # admitted in an earlier state: it no longer speaks for this one
        if self.state is State.CLOSED:
            if not failed and not slow and not self.window.sums[1] and not self.window.sums[2]:
                # A success with no failure or slow call in the window: nothing can trip.
                w = self.window
                w.advance(now)[0] += 1
                w.sums[0] += 1
                self.consecutive = 0
                return None
            return self._record_closed(now, failed, slow)
        probe = ticket & MAX_PROBES
        if self.state is not State.HALF_OPEN or not probe or not self.probe_open[probe - 1]:
            return None
        self.probe_open[probe - 1] = False
        if failed or slow:
            return self._reopen(now, "probe failed" if failed else "probe slow")
        self.probes_ok += 1
        if self.probes_ok >= self.p.half_open_probes:
            return self._fire(Event.PROBE_OK, now, f"{self.probes_ok} probes succeeded")
        return None

    def ignore(self, ticket: int) -> None:
        """A result that says nothing about the backend (client gone): free its probe slot."""
        if ticket < 0 or ticket >> _PROBE_BITS != self.epoch or self.state is not State.HALF_OPEN:
            return
        probe = ticket & MAX_PROBES
        if probe and self.probe_open[probe - 1]:
            self.probe_open[probe - 1] = False
            self.probes_started -= 1  # another request may probe instead

    def _record_closed(self, now: float, failed: bool, slow: bool) -> Change | None:
        p = self.p
        w = self.window
        row = w.advance(now)
        sums = w.sums
        row[0] += 1
        sums[0] += 1
        if failed:
            row[1] += 1
            sums[1] += 1
            self.consecutive += 1
            if p.consecutive_failures and self.consecutive >= p.consecutive_failures:
                return self._trip(now, f"{self.consecutive} consecutive failures")
        else:
            self.consecutive = 0
        if slow:
            row[2] += 1
            sums[2] += 1
        n = sums[0]
        if n >= p.min_requests:
            if sums[1] >= p.error_ratio * n:
                return self._trip(now, f"error ratio {sums[1] / n:.2f} over {n} requests")
            if sums[2] >= p.slow_ratio * n:
                return self._trip(now, f"slow-call ratio {sums[2] / n:.2f} over {n} requests")
        return None

    # --- time --------------------------------------------------------------------------------
    def tick(self, now: float) -> Change | None:
        """Transitions that time alone causes: open time over, a probe that never answered."""
        change = None
        if self.state is State.OPEN and now >= self.open_until:
            change = self._fire(Event.COOLDOWN_ELAPSED, now, "open time elapsed")
        if self.state is State.HALF_OPEN:
            change = self._expire_probes(now) or change
        return change

    def next_deadline(self) -> float:
        """When `tick` may next change something (math.inf: nothing is due)."""
        if self.state is State.OPEN:
            return self.open_until
        if self.state is State.HALF_OPEN:
            t = self.p.probe_timeout_s
            due = [s + t for s, o in zip(self.probe_started, self.probe_open, strict=True) if o]
            return min(due, default=math.inf)
        return math.inf

    def pending_probes(self) -> list[int]:
        """Tickets of the probes still awaiting their result (oldest first)."""
        if self.state is not State.HALF_OPEN:
            return []
        base = self.epoch << _PROBE_BITS
        return [base | (i + 1) for i, o in enumerate(self.probe_open) if o]

    def _expire_probes(self, now: float) -> Change | None:
        t = self.p.probe_timeout_s
        for s, o in zip(self.probe_started, self.probe_open, strict=True):
            if o and now >= s + t:
                return self._reopen(now, f"probe unanswered after {t:g}s")
        return None

    # --- transitions -------------------------------------------------------------------------
    def _trip(self, now: float, reason: str) -> Change:
        return self._fire(Event.TRIPPED, now, reason)

    def _reopen(self, now: float, reason: str) -> Change:
        return self._fire(Event.PROBE_FAILED, now, reason)

    def _fire(self, event: Event, now: float, reason: str) -> Change:
        old = self.state
        new = TRANSITIONS.get((old, event), old)
        change = Change(old, new, event, reason)
        if new is old:
            return change
        self.state = new
        self.epoch += 1
        if new is State.OPEN:
            p = self.p
            base = min(p.max_open_s, p.open_s * (2.0**self.reopens))
            self.open_until = now + base * (1.0 + JITTER * (2.0 * self._random() - 1.0))
            self.reopens += 1
        elif new is State.CLOSED:
            self.reopens = 0
        self.consecutive = 0
        self.window.clear()
        self.probes_started = self.probes_ok = 0
        self.probe_started = []
        self.probe_open = []
        self.last_change = change
        return change

    def snapshot(self, now: float) -> dict[str, object]:
        n, failed, slow = self.window.totals(now)
        out: dict[str, object] = {
            "state": self.state.value,
            "window": {"requests": n, "failures": failed, "slow": slow},
            "consecutive_failures": self.consecutive,
            "reopens": self.reopens,
        }
        if self.state is State.OPEN:
            out["open_for_s"] = round(max(0.0, self.open_until - now), 3)
        if self.state is State.HALF_OPEN:
            out["probes"] = {"started": self.probes_started, "ok": self.probes_ok}
        if self.last_change is not None:
            out["last_change"] = f"{self.last_change.event.value}: {self.last_change.reason}"
        return out
