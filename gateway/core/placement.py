"""(compiled) Where each prompt prefix is served: sticky placement with bounded load, per backend.

Pure: `now` is passed in; the pool keeps one `PrefixBook` per backend (it outlives reloads).

A per-request bound on requests in flight (consistent hashing with bounded loads, Mirrokni et
al. 2018, capacity `ceil(load_factor × mean)`) spills on noise when a member has a few requests
in flight: at 70 % of capacity with ~3 in flight per member, a quarter of the requests of the
affinity benchmark found their member at its capacity of 4 and went, each alone, to a member
that did not hold their prefix (a full prefill). So the bound is kept on *time-averaged* loads
and moves whole prefixes, not single requests:

- **Placement**: the book remembers each prefix's member (bounded, least recently used dropped
  first). A prefix seen for the first time, or whose member left, starts on the first member
  of its rendezvous order (the same choice on every replica, and losing a member moves only its
  own prefixes) that is within its bound.
- **Smoothed loads**: each member's load (in flight + heartbeat load / 10) is averaged over
  time, `SMOOTH_S` seconds (an exponentially weighted time average, brought up to date at
  placements at most every `STEP_S`, kept with the member's live figures); each prefix's own
  requests in flight are averaged the same way (`Placement.add` at their start and end).
- **Bounded load, on the averages**: a member is over its bound when its average is above
  `load_factor × Σ averages × weight / Σ weights` (and above one request). A prefix whose member
  is over it moves to the first member of its rendezvous order whose average plus the prefix's
  own stays within that member's plain share (no factor: room left, so that the prefix does not
  move back at the next swing) and below the old member's; the prefix's average is moved
  between the two members' at once, so one overloaded member sheds one prefix per request
  instead of all of them before its average catches up. Nobody fits: it stays.
- **Bursts**: a member whose requests in flight right now, the new one counted, pass
  `max(ceil(load_factor × mean), mean + BURST_SLACK)` (the mean after placing, by weight) sends
  this request alone to the next member of the prefix's order with room; the placement stays.
  With many requests in flight this is Mirrokni's bound, so a burst of one prefix never piles
  onto one member (vllm-project/router#179); with a few, noise a GPU batch absorbs does not
  cost a prefill (AIBrix's prefix-cache router tolerates the same 8 requests of imbalance
  before it balances, pkg/plugins/gateway/algorithms/README.md).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final, Protocol, TypeVar

from gateway.core.balancer import LOAD_GAIN, Load


class Averaged(Load, Protocol):
    """A member's live figures with its load averaged over time (kept with them, shared by
    every policy that names the member); `avg_at` < 0: not averaged yet."""

    avg: float
    avg_at: float


class Placeable(Protocol):
    """What the placement reads of a member."""

    weight: float
    hash_key: int

    @property
    def core(self) -> Averaged: ...


M = TypeVar("M", bound=Placeable)

SMOOTH_S: Final = 3.0  # time constant of the load averages: long enough that noise moves no prefix
STEP_S: Final = 0.05  # an average is brought up to date at most this often (1/60 of SMOOTH_S)
BURST_SLACK: Final = 8.0  # requests in flight a member may take above the mean in a burst
MAX_PLACED: Final = 16_384  # prefixes remembered per backend
_GOLDEN: Final = 0x9E3779B97F4A7C15
_MASK: Final = (1 << 64) - 1
_UNIT: Final = float(1 << 53)


def smooth(avg: float, value: float, dt: float) -> float:
    """The time average `avg` after `dt` seconds at `value` (a step function's exact EWMA)."""
    if dt <= 0.0:
        return avg
    return value + (avg - value) * math.exp(-dt / SMOOTH_S)


class Placement:
    """One prefix: its member (by `hash_key`) and its own requests in flight, averaged."""

    __slots__ = ("member", "load", "in_flight", "at")

    def __init__(self, member: int, now: float) -> None:
        self.member = member
        self.load = 0.0  # time average of `in_flight` up to `at`
        self.in_flight = 0
        self.at = now

    def add(self, now: float, n: int) -> None:
        """`n` of the prefix's requests start (+1) or end (-1) at `now`."""
        x = self.in_flight
        dt = now - self.at
        if dt >= STEP_S:  # smooth(), inlined: twice per request
            self.load = x + (self.load - x) * math.exp(-dt / SMOOTH_S)
            self.at = now
        self.in_flight = x + n if x + n > 0 else 0

    def current(self, now: float) -> float:
        return smooth(self.load, self.in_flight, now - self.at)


class PrefixBook:
    """One backend's prefix placements (see the module docstring)."""

    __slots__ = ("placed", "capacity", "lru", "moves")

    def __init__(self, capacity: int = MAX_PLACED) -> None:
        self.placed: OrderedDict[int, Placement] = OrderedDict()
        self.capacity = capacity
        self.lru = False  # half full: each use keeps a prefix from being forgotten
        self.moves = 0  # prefixes moved off a member over its bound

    def started(self, key: int, now: float) -> None:
        """A request of prefix `key` went upstream without `place` (a half-open probe)."""
        p = self.placed.get(key)
        if p is not None:
            p.add(now, 1)

    def finished(self, key: int, now: float) -> None:
        """A request of prefix `key` that `place` counted ended (or never went upstream)."""
        p = self.placed.get(key)
        if p is not None:
            p.add(now, -1)

    def where(self, key: int) -> int | None:
        """The `hash_key` of the member prefix `key` is placed on (None: not placed)."""
        p = self.placed.get(key)
        return p.member if p is not None else None

    def add(self, key: int, member: int, now: float) -> Placement:
        """Place a new prefix (the least recently used one is forgotten beyond `capacity`)."""
        p = self.placed[key] = Placement(member, now)
        n = len(self.placed)
        if n > self.capacity:
            self.placed.popitem(last=False)
        self.lru = n > self.capacity // 2
        return p

    def put(self, key: int, p: Placement | None, member: int, now: float) -> Placement:
        """Place prefix `key` (its record `p`, None when new) on `member`."""
        if p is None:
            return self.add(key, member, now)
        p.member = member
        if self.lru:
            self.placed.move_to_end(key)
        return p


def rank(key: int, m: Placeable, uniform: bool) -> float:
    """The member's rendezvous score for the key: one multiply-xorshift round of both (enough
    to order a few members), weighted as `weight / -ln(u)` unless all weights are equal."""
    h = ((key ^ m.hash_key) * _GOLDEN) & _MASK
    h ^= h >> 29
    return float(h) if uniform else m.weight / -math.log(((h >> 11) + 0.5) / _UNIT)


def _score(m: Placeable) -> float:
    c = m.core
    return c.in_flight + c.load * LOAD_GAIN + c.server


def place(
    book: PrefixBook,
    members: Sequence[M],
    key: int,
    load_factor: float,
    now: float,
    uniform: bool = False,
    keep: bool = True,
) -> M | None:
    """The member for a request of prefix `key` among `members` (see the module docstring),
    the request counted in the prefix's load (the caller calls `book.finished` when it ends,
    or at once if it does not go upstream). `keep`: record the choice as the prefix's
    placement (False for a retry's choice, which leaves the placement where it was)."""
    if not members:
        return None
    p = book.placed.get(key)
    if len(members) == 1:
        if p is not None:
            p.add(now, 1)
        return members[0]
    where = p.member if p is not None else -1
    total_s = total_l = total_w = 0.0
    first: M | None = None
    a = last_dt = 0.0
    for m in members:  # the averages brought up to `now` (one pass: the hot loop)
        c = m.core
        x = c.in_flight + c.load * LOAD_GAIN + c.server
        dt = now - c.avg_at
        if c.avg_at < 0.0:
            c.avg, c.avg_at = x, now
        elif dt >= STEP_S:
            if dt != last_dt:  # members updated together share one exp()
                a, last_dt = math.exp(-dt / SMOOTH_S), dt
            c.avg = x + (c.avg - x) * a
            c.avg_at = now
        total_l += x
        total_s += c.avg
        total_w += m.weight
        if m.hash_key == where:
            first = m
    if first is None:  # not placed yet, or its member is not among these
        first = max(members, key=lambda m: rank(key, m, uniform))
    after = (total_l + 1.0) / total_w  # the mean after placing, per unit of weight
    c = first.core
    w = first.weight
    if c.in_flight + c.load * LOAD_GAIN + c.server + 1.0 > max(
        math.ceil(load_factor * after * w), after * w + BURST_SLACK
    ):  # a burst: this request alone goes to the next member with room
        got = next((m for m in _ranked(members, key, uniform, first)
                    if _fits(m, load_factor, after)), None)  # fmt: skip
        if got is None:
            got = min(members, key=lambda m: _score(m) / m.weight)
    elif c.avg <= load_factor * total_s / total_w * w or c.avg <= 1.0:
        got = first  # the common case: its member is within its bound
        if keep:
            if p is None:
                p = book.add(key, first.hash_key, now)
            elif p.member != first.hash_key:
                p.member = first.hash_key
            elif book.lru:
                book.placed.move_to_end(key)
    else:
        got = _move(book, members, key, p, first, load_factor, after, now, uniform, keep)
        if keep:
            p = book.placed[key]
    if p is not None:
        p.add(now, 1)
    return got


def _move(
    book: PrefixBook,
    members: Sequence[M],
    key: int,
    p: Placement | None,
    first: M,
    load_factor: float,
    after: float,
    now: float,
    uniform: bool,
    keep: bool,
) -> M:
    """`first` is over its bound: the prefix moves to the first member of its order with room
    for it (its average moved along), or stays."""
    share = sum((m.core.avg for m in members), 0.0) / sum((m.weight for m in members), 0.0)
    own = p.current(now) if p is not None else 0.0
    fc = first.core
    for m in _ranked(members, key, uniform, first):
        c = m.core
        room = c.avg + own <= share * m.weight and c.avg + own < fc.avg
        if room and _fits(m, load_factor, after):
            fc.avg = max(0.0, fc.avg - own)
            c.avg += own
            if keep:
                book.put(key, p, m.hash_key, now)
                book.moves += 1
            return m
    if keep:
        book.put(key, p, first.hash_key, now)
    return first  # nobody has room for it: it stays


def _fits(m: Placeable, load_factor: float, after: float) -> bool:
    w = m.weight
    return _score(m) + 1.0 <= max(math.ceil(load_factor * after * w), after * w + BURST_SLACK)


def _ranked(members: Sequence[M], key: int, uniform: bool, first: M) -> list[M]:
    """The members but `first`, in the key's rendezvous order."""
    rest = [m for m in members if m is not first]
    rest.sort(key=lambda m: rank(key, m, uniform), reverse=True)
    return rest
