"""(compiled) Time as an injected dependency, so decisions are deterministic under test."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    """The production clock: seconds from `time.monotonic()`."""

    def now(self) -> float:
        return time.monotonic()


def reader(clock: Clock) -> Callable[[], float]:
    """The clock's `now` as a plain function: `time.monotonic` itself for the production clock
    (a call of a C function, not of a method that calls it)."""
    return time.monotonic if type(clock) is MonotonicClock else clock.now


@dataclass
class ManualClock:
    """A clock tests move by hand: `clock.t += 0.5`."""

    t: float = 0.0

    def now(self) -> float:
        return self.t
