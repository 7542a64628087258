"""(compiled) Token budgets: periods, weighted cost, and one replica's ledger of a budget key. Pure.

- A **period** is calendar (`day`, `week` from Monday, `month`, in an IANA time zone, daylight
  saving included) or fixed-length (`rolling: 30d`: consecutive windows of that length counted
  from the Unix epoch, so every replica agrees on the edges). `window(period, now)` gives the
  period's id (part of the budget's key: a new period is a new, empty tally) and the exact
  instant it ends; at that instant, not a moment later, the next period starts.
- The **cost** of a request is `input tokens × input weight + output tokens × output weight`
  (rounded up to a whole token), with weights per model where the policy names them.
- A **ledger** is what one replica holds of one budget key in one period: `avail`, the tokens it
  may still reserve (the whole remaining budget without a store; its leased share with one),
  and `reserved`, the reservations of requests in flight. A request reserves its output cap and
  prompt estimate at admission (refused when that does not fit `avail`: no check-then-increment)
  and settles to the backend's reported usage at its end; the rest goes back to `avail`. What
  was used and not yet reported to the store waits in `unreported` (the store's sync moves it).
- **Warnings**: the first `warn_at` fraction of the limit a settlement crosses.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final
from zoneinfo import ZoneInfo

UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
DURATION: Final = re.compile(r"^([1-9][0-9]{0,6})([smhdw])$")
CALENDAR = ("day", "week", "month")


def parse_duration(text: str) -> int:
    """`10s`, `15m`, `12h`, `30d`, `2w` → seconds; ValueError otherwise."""
    m = DURATION.match(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a duration like 10s, 15m, 12h, 30d or 2w")
    return int(m.group(1)) * UNITS[m.group(2)]


@dataclass(frozen=True, slots=True)
class Period:
    """`calendar` ("day" | "week" | "month", in `timezone`) or `rolling_s` seconds (> 0)."""

    calendar: str = ""
    timezone: str = "UTC"
    rolling_s: int = 0

    @property
    def label(self) -> str:
        if self.calendar:
            return f"{self.calendar} ({self.timezone})"
        return f"rolling {self.rolling_s}s"


@dataclass(frozen=True, slots=True)
class Window:
    """One period: its id (stable across replicas), when it began and when it ends (Unix s)."""

    id: str
    start: float
    end: float


def window(p: Period, now: float) -> Window:
    """The period that contains `now` (Unix seconds). `end` is exclusive: at `end` exactly
    the next period has begun."""
    if not p.calendar:
        n = p.rolling_s
        k = math.floor(now / n)
        return Window(f"r{n}-{k}", float(k * n), float((k + 1) * n))
    tz = ZoneInfo(p.timezone)
    local = datetime.fromtimestamp(now, tz)
    if p.calendar == "day":
        start = datetime(local.year, local.month, local.day, tzinfo=tz)
        nxt = start.date() + timedelta(days=1)
        ident = f"d{start.date().isoformat()}"
    elif p.calendar == "week":
        day = local.date() - timedelta(days=local.weekday())
        start = datetime(day.year, day.month, day.day, tzinfo=tz)
        nxt = day + timedelta(days=7)
        ident = f"w{day.isoformat()}"
    elif p.calendar == "month":
        start = datetime(local.year, local.month, 1, tzinfo=tz)
        nxt = (start.date().replace(day=28) + timedelta(days=4)).replace(day=1)
        ident = f"m{local.year:04d}-{local.month:02d}"
    else:
        raise ValueError(f"unknown calendar period {p.calendar!r}")
    end = datetime(nxt.year, nxt.month, nxt.day, tzinfo=tz)
    return Window(ident, start.timestamp(), end.timestamp())


@dataclass(frozen=True, slots=True)
class Weights:
    input: float = 1.0
    output: float = 1.0


@dataclass(frozen=True, slots=True)
class Cost:
    """Weights per token kind, with overrides per model name."""

    default: Weights = field(default_factory=Weights)
    models: Mapping[str, Weights] = field(default_factory=dict)
    plain: bool = False  # every weight 1: the plain sum, a shortcut (`cost()` sets it)

    def weights(self, model: str | None) -> Weights:
        if model is not None and self.models:
            return self.models.get(model, self.default)
        return self.default

    def of(self, model: str | None, input_tokens: int, output_tokens: int) -> int:
        """The weighted cost, rounded up to a whole token (weights 1: the plain sum)."""
        if self.plain:
            return input_tokens + output_tokens
        w = self.weights(model)
        if w.input == 1.0 and w.output == 1.0:
            return input_tokens + output_tokens
        return math.ceil(input_tokens * w.input + output_tokens * w.output - 1e-9)


def cost(default: Weights, models: Mapping[str, Weights] | None = None) -> Cost:
    """A `Cost`, knowing whether it is the plain sum."""
    m = dict(models or {})
    flat = default.input == 1.0 and default.output == 1.0 and not m
    return Cost(default, m, flat)


def crossed(limit: int, before: int, after: int, warn_at: Sequence[float]) -> float | None:
    """The highest `warn_at` fraction of `limit` that going from `before` to `after` tokens
    spent passed (None: none)."""
    if limit <= 0:
        return None
    hit = None
    for f in warn_at:
        mark = f * limit
        if before < mark <= after:
            hit = f if hit is None or f > hit else hit
    return hit


def level(limit: int, spent: int, warn_at: Sequence[float]) -> float | None:
    """The highest `warn_at` fraction already reached by `spent` (None: none)."""
    if limit <= 0:
        return None
    hit = None
    for f in warn_at:
        if spent >= f * limit and (hit is None or f > hit):
            hit = f
    return hit


class Ledger:
    """One replica's view of one budget key in one period (see the module docstring).

    Without a store, `avail` starts at the limit and the ledger is the whole truth. With one,
    `avail` is the share leased from the store (`granted`), `unreported` what requests used
    since the last sync, and `epoch` counts the times the store declared this replica's lease
    lost (its open reservations were then counted as spent there and its free share went back;
    a reservation of an older epoch gives nothing back to the share when it settles, and its
    usage is still reported: the store's tally is then the served usage plus at most the
    expired reservations)."""

    __slots__ = (
        "limit", "window", "avail", "reserved", "orphans", "used", "unreported", "epoch",
        "granted", "grant", "remote_used", "remote_reserved", "warned", "touched",
    )  # fmt: skip

    def __init__(self, limit: int, win: Window, avail: int | None = None) -> None:
        self.limit = limit
        self.window = win
        self.avail = limit if avail is None else avail
        self.reserved = 0  # open reservations of this replica
        self.orphans = 0  # open reservations of an older epoch (counted as spent by the store)
        self.grant = 0  # tokens an operator added to this period (without a store)
        self.used = 0  # settled by this replica in this period
        self.unreported = 0  # used, not yet reported to the store
        self.epoch = 0
        self.granted = 0  # leased from the store, in total
        self.remote_used = 0  # the store's tally at the last sync (all replicas)
        self.remote_reserved = 0  # the store's open reservations at the last sync
        self.warned: float | None = None  # the highest warn_at fraction passed
        self.touched = 0.0

    @property
    def holding(self) -> int:
        """What this replica holds of the budget: its free share and its reservations."""
        return self.avail + self.reserved

    def reserve(self, amount: int, overdraft: bool = False) -> bool:
        """Take `amount` from the free share; False (nothing taken) when it does not fit,
        unless `overdraft` (the store is away and the rule fails open)."""
        if amount > self.avail and not overdraft:
            return False
        self.avail -= amount
        self.reserved += amount
        return True

    def settle(self, reserved: int, used: int, epoch: int = 0) -> int:
        """A request that reserved `reserved` used `used`: the rest goes back to the share (a
        use above the reservation is charged in full). Returns the tokens charged here."""
        if epoch != self.epoch:  # its lease was lost: nothing of it is held any more
            self.orphans -= reserved
        else:
            self.reserved -= reserved
            self.avail += reserved - used
            if self.avail + self.reserved < 0:  # charged above all it held: the store clamps too
                self.avail = -self.reserved
        self.used += used
        self.unreported += used
        return used

    def release(self, reserved: int, epoch: int = 0) -> None:
        """A reservation given back whole (the request was refused later, or never started)."""
        self.settle(reserved, 0, epoch)

    def lost(self) -> None:
        """The store expired this replica's lease: reservations in flight were counted as spent
        there, the free share went back. Start a new epoch with nothing held."""
        self.epoch += 1
        self.avail = 0
        self.orphans += self.reserved
        self.reserved = 0

    def adjust(self, limit: int) -> None:
        """Without a store: the key's amount changed (a claim, the file, `tokens`)."""
        if limit != self.limit:
            self.avail += limit - self.limit
            self.limit = limit

    def add(self, tokens: int) -> None:
        """Without a store: an operator grants `tokens` more for this period."""
        self.grant += tokens
        self.avail += tokens

    def reset(self) -> None:
        """Without a store: the period's tally starts over (reservations in flight stay)."""
        self.used = 0
        self.grant = 0
        self.warned = None
        self.avail = self.limit - self.reserved


def share_plan(avail: int, target: int, idle: bool) -> tuple[int, int]:
    """What a replica asks of the store for one key: (tokens to give back, tokens to lease).
    It keeps about `target` free: leases when below half of it, gives back what is above
    twice of it, and everything when the key is idle (nothing reserved, nothing asked)."""
    if idle:
        return (avail if avail > 0 else 0), 0
    if avail < target // 2 + 1:
        return 0, target - avail
    if avail > 2 * target:
        return avail - target, 0
    return 0, 0
