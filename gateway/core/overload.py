"""(compiled) The overload colour: green / yellow / red with hysteresis, and whom each colour sheds.
Pure.

Two signals in, one colour out. For a limit key: the offered QPS utilisation (every arrival,
admitted or not, over the limit: the demand) and the token utilisation; a rule with only one of
the two limits reads 0 for the other, so its keys can turn yellow but not red. For a backend
pool: in flight / adaptive limit, standing for both (a saturated pool does turn red). The
signals are sorted into a band, and the colour moves by the `(colour, band)` table below; pairs
not listed keep the colour. With the golden thresholds (green < 0.80, yellow > 0.85, red > 0.95):

    band      signals                                   green   yellow  red
    LOW       both < 0.80                               green   green   green
    HOLD      the higher one in [0.80, 0.85]            green   yellow  yellow
    HIGH      one > 0.85, the other <= 0.85             yellow  yellow  yellow
    BOTH      both > 0.85, not both > 0.95              yellow  yellow  red
    CRITICAL  both > 0.95                               red     red     red

So a key turns yellow when any signal passes 0.85 and green only once both are under 0.80
(between the bands the colour holds); it turns red when both pass 0.95 and leaves red only when
a signal falls back to 0.85 or below.

Shedding (by priority class, 0 = highest): yellow sheds the lowest class; red sheds every class
but the highest. With a single class nothing is shed by colour (there is nobody to shed ahead
of); the limits themselves still refuse.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class Colour(enum.IntEnum):
    GREEN = 0
    YELLOW = 1
    RED = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Band(enum.IntEnum):
    LOW = 0
    HOLD = 1
    HIGH = 2
    BOTH = 3
    CRITICAL = 4


_TRANSITIONS: dict[tuple[Colour, Band], Colour] = {
    (Colour.GREEN, Band.HIGH): Colour.YELLOW,
    (Colour.GREEN, Band.BOTH): Colour.YELLOW,
    (Colour.GREEN, Band.CRITICAL): Colour.RED,
    (Colour.YELLOW, Band.LOW): Colour.GREEN,
    (Colour.YELLOW, Band.CRITICAL): Colour.RED,
    (Colour.RED, Band.LOW): Colour.GREEN,
    (Colour.RED, Band.HOLD): Colour.YELLOW,
    (Colour.RED, Band.HIGH): Colour.YELLOW,
}  # pairs not listed leave the colour unchanged

# The same table as a flat tuple indexed by colour * 5 + band: the request path's lookup
# (`step` without the call, for the per-key loops of gateway.core.keystate).
NEXT_COLOUR: Final[tuple[Colour, ...]] = tuple(
    _TRANSITIONS.get((c, b), c) for c in Colour for b in Band
)


@dataclass(frozen=True, slots=True)
class Thresholds:
    green_below: float = 0.80
    yellow_above: float = 0.85
    red_above: float = 0.95

    def band(self, a: float, b: float) -> Band:
        hi, lo = (a, b) if a >= b else (b, a)
        if hi < self.green_below:
            return Band.LOW
        if hi <= self.yellow_above:
            return Band.HOLD
        if lo > self.red_above:
            return Band.CRITICAL
        if lo > self.yellow_above:
            return Band.BOTH
        return Band.HIGH


def step(colour: Colour, band: Band) -> Colour:
    return NEXT_COLOUR[colour * 5 + band]


def sheds(colour: Colour, priority: int, top: int, lowest: int) -> bool:
    """Whether a request of `priority` is shed in `colour` (top/lowest: the policy's highest
    and lowest classes; top == lowest means one class)."""
    if colour is Colour.GREEN or top >= lowest:
        return False
    if colour is Colour.RED:
        return priority > top
    return priority >= lowest


class ColourMachine:
    """One colour with the time it was entered (for state and the transition log)."""

    __slots__ = ("colour", "since")

    def __init__(self, now: float = 0.0) -> None:
        self.colour = Colour.GREEN
        self.since = now

    def update(self, band: Band, now: float) -> Colour | None:
        """Apply one band; return the new colour if it changed, else None."""
        new = NEXT_COLOUR[self.colour * 5 + band]
        if new is self.colour:
            return None
        self.colour = new
        self.since = now
        return new


class History:
    """The worst colour seen in each second of the last `seconds` (bounded ring), for the
    status page and /admin/state."""

    __slots__ = ("seconds", "_slots")

    def __init__(self, seconds: int = 300) -> None:
        self.seconds = seconds
        self._slots: dict[int, int] = {}

    def note(self, colour: Colour, now: float) -> None:
        sec = int(now)
        worst = self._slots.get(sec)
        if worst is None:
            self._slots[sec] = int(colour)
            if len(self._slots) > self.seconds:
                for old in [s for s in self._slots if s <= sec - self.seconds]:
                    del self._slots[old]
        elif colour > worst:
            self._slots[sec] = int(colour)

    def series(self, now: float) -> list[tuple[int, str]]:
        """(seconds ago, colour) for each second that has an entry, oldest first; the
        seconds without one were green (nothing was noted above green there)."""
        sec = int(now)
        return [
            (sec - s, Colour(c).label)
            for s, c in sorted(self._slots.items())
            if sec - s < self.seconds
        ]
