"""(compiled) Endpoint choice: a route's split between backends, then one member of the chosen
backend.

Pure: the inputs are a snapshot of each member's state (weight, priority, availability) built by
the pool in the services, the members' live in-flight counts and heartbeat load, and an injected
`random() -> float in [0, 1)`; no I/O, no clock.

- **Split between a route's backends**: smooth weighted round robin (the nginx algorithm), exact
  shares and an even interleaving; weights may change per pick (a guarded canary, a backend with
  no member left, get 0 and their share goes to the others).
- **Priority levels** (0 = primary, 1 = secondary, ...): as Envoy does, each level's health is
  `min(1, 1.4 × available weight / total weight)` (1.4 = over-provisioning: a level with 72 % of
  its members up still takes all of its traffic) and traffic fills the levels in order: with the
  primary at 50 %, 70 % stays there and 30 % spills to the secondary; with the primary all down,
  everything goes to the secondary.
- **Panic threshold** (per backend, default 0.5): when the levels together cannot take all
  traffic (their health sums below 1) and a level has fewer than `panic_threshold` of its weight
  available, that level is in panic: its members failing health checks or ejected as outliers
  are used again, spread like the others, because concentrating all traffic on the few left
  would overload them too, and the checks may be wrong. Members whose breaker is open stay out
  (a breaker is the fail-fast signal); with none left the answer is 503 `no_healthy_upstream`.
  With `panic_threshold: 0` an unavailable member is never used.
- **Within a level**: weighted power of two choices. Two distinct members are drawn (the first in
  proportion to weight) and the one with the lower `(in_flight + load / 10) ÷ weight` wins, ties
  to the first, so idle members share in proportion to weight and busy ones shed load. `load` is
  the member's heartbeat load (0-100): a full server counts as 10 more requests in flight from
  this gateway, so the fleet-wide view steers as well as the local one. With `load.metrics`,
  the model server's own figures add `server` requests (`gateway.core.serverload.score`: load
  this gateway did not send, its waiting queue, its KV-cache use).
- **Sticky mode**: a key (e.g. a hash of a user-id header) picks the level and, by weighted
  rendezvous hashing, the member: the same key lands on the same member while it is available,
  and a member's loss only moves its own keys.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

OVERPROVISION: Final = 1.4
LOAD_GAIN: Final = 0.1  # in-flight requests one load point counts as: load 100 → 10
_MASK: Final = (1 << 64) - 1

Random = Callable[[], float]


class SmoothWeightedRoundRobin:
    """Pure: the state is a list of current weights; `pick` returns an index into the peers
    given at construction. Peers with weight 0 are never picked."""

    __slots__ = ("_weights", "_current", "_total", "_single")

    def __init__(self, weights: Sequence[float]) -> None:
        self._weights = [float(w) for w in weights]
        self._current = [0.0] * len(self._weights)
        self._total = sum((w for w in self._weights if w > 0), 0.0)
        live = [i for i, w in enumerate(self._weights) if w > 0]
        self._single = live[0] if len(live) == 1 else None

    def pick(self) -> int | None:
        """Index of the next peer, or None when every weight is 0."""
        if self._single is not None:
            return self._single
        if self._total <= 0:
            return None
        return self.pick_with(self._weights)

    def pick_with(self, weights: Sequence[float]) -> int | None:
        """Like `pick`, with this pick's weights (same length as at construction)."""
        best = -1
        best_w = 0.0
        total = 0.0
        cur = self._current
        for i, w in enumerate(weights):
            if w <= 0:
                continue
            total += w
            cur[i] += w
            if best < 0 or cur[i] > best_w:
                best, best_w = i, cur[i]
        if best < 0:
            return None
        cur[best] -= total
        return best


class Load(Protocol):
    """A member's live figures, shared by every policy that names it."""

    in_flight: int
    load: float  # heartbeat load 0-100 (0 for static members)
    server: float  # in-flight requests the model server's own figures add (gateway.core.serverload)


class Candidate(Protocol):
    """What the balancer reads of a member at pick time."""

    weight: float
    hash_key: int  # stable 64-bit identity for rendezvous hashing

    @property
    def core(self) -> Load: ...


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """One member's state at plan time (the pool builds these from health, breaker, outlier)."""

    member: Candidate
    priority: int
    weight: float
    available: bool  # healthy, not ejected, breaker closed
    admissible: bool  # its breaker would admit a request (closed, or half-open with a slot)
    probing: bool = False  # half-open: it should get its probes


@dataclass(frozen=True, slots=True)
class Level:
    priority: int
    members: tuple[Candidate, ...]
    cum: tuple[float, ...]  # cumulative weights of `members`
    uniform: bool  # all weights equal: draw by index
    panic: bool


@dataclass(frozen=True, slots=True)
class Plan:
    levels: tuple[Level, ...]  # levels that take traffic, in priority order
    cum_load: tuple[float, ...]  # cumulative share of traffic per level (last = 1)
    probing: tuple[Candidate, ...]  # half-open members, to be offered their probes first
    members: int  # members in rotation (weight > 0)
    available: int

    @property
    def empty(self) -> bool:
        return not self.levels and not self.probing


@dataclass(slots=True)
class _Acc:
    total_w: float = 0.0
    avail_w: float = 0.0
    avail: list[tuple[Candidate, float]] | None = None
    fallback: list[tuple[Candidate, float]] | None = None


def build_plan(
    statuses: Sequence[MemberStatus],
    panic_threshold: float,
    overprovision: float = OVERPROVISION,
) -> Plan:
    """The traffic plan of one backend (see the module docstring for the rules)."""
    accs: dict[int, _Acc] = {}
    probing: list[Candidate] = []
    members = available = 0
    for s in statuses:
        if s.probing:
            probing.append(s.member)
        if s.weight <= 0:
            continue
        members += 1
        acc = accs.get(s.priority)
        if acc is None:
            acc = accs[s.priority] = _Acc(avail=[], fallback=[])
        assert acc.avail is not None and acc.fallback is not None
        acc.total_w += s.weight
        if s.available:
            available += 1
            acc.avail_w += s.weight
            acc.avail.append((s.member, s.weight))
        elif s.admissible:
            acc.fallback.append((s.member, s.weight))
    order = sorted(accs)
    health = [min(1.0, overprovision * accs[p].avail_w / accs[p].total_w) for p in order]
    sum_h = sum(health, 0.0)
    levels: list[Level] = []
    loads: list[float] = []
    if sum_h <= 0:
        # Nothing available anywhere: in panic, the first level with an admissible member.
        if panic_threshold > 0:
            for p in order:
                acc = accs[p]
                assert acc.fallback is not None
                if acc.fallback:
                    levels.append(_level(p, acc.fallback, True))
                    loads.append(1.0)
                    break
    else:
        short = sum_h < 1.0
        remaining = 1.0
        for p, h in zip(order, health, strict=True):
            load = h / sum_h if short else min(h, remaining)
            remaining -= load
            if load <= 0:
                continue
            acc = accs[p]
            assert acc.avail is not None and acc.fallback is not None
            share = acc.avail_w / acc.total_w
            panic = short and share < panic_threshold
            chosen = acc.avail + acc.fallback if panic else acc.avail
            levels.append(_level(p, chosen, panic))
            loads.append(load)
    cum: list[float] = []
    run = 0.0
    for x in loads:
        run += x
        cum.append(run)
    if cum:
        cum[-1] = 1.0
    return Plan(tuple(levels), tuple(cum), tuple(probing), members, available)


def _level(priority: int, chosen: list[tuple[Candidate, float]], panic: bool) -> Level:
    cum: list[float] = []
    run = 0.0
    for _, w in chosen:
        run += w
        cum.append(run)
    uniform = len({w for _, w in chosen}) <= 1
    return Level(priority, tuple(m for m, _ in chosen), tuple(cum), uniform, panic)


def _choose_level(plan: Plan, r: float) -> Level:
    levels = plan.levels
    if len(levels) == 1:
        return levels[0]
    i = bisect.bisect_right(plan.cum_load, r)
    return levels[i if i < len(levels) else -1]


def pick(plan: Plan, random: Random) -> Candidate | None:
    """Weighted power of two choices within a level chosen by the levels' traffic shares."""
    levels = plan.levels
    if not levels:
        return None
    lv = levels[0] if len(levels) == 1 else _choose_level(plan, random())
    ms = lv.members
    n = len(ms)
    if n == 1:
        return ms[0]
    if lv.uniform:
        i = int(random() * n)
        j = int(random() * (n - 1))
        if j >= i:
            j += 1
    else:
        cum = lv.cum
        i = bisect.bisect_right(cum, random() * cum[-1])
        if i >= n:
            i = n - 1
        j = int(random() * (n - 1))
        if j >= i:
            j += 1
    a = ms[i]
    b = ms[j]
    ca, cb = a.core, b.core
    sa = (ca.in_flight + ca.load * LOAD_GAIN + ca.server) / a.weight
    sb = (cb.in_flight + cb.load * LOAD_GAIN + cb.server) / b.weight
    return a if sa <= sb else b


def pick_excluding(plan: Plan, random: Random, exclude: Collection[Candidate]) -> Candidate | None:
    """`pick` without the members in `exclude` (a retry goes elsewhere): the chosen level first,
    then the others in priority order; None when every member is excluded."""
    if not plan.levels:
        return None
    first = _choose_level(plan, random())
    order = [first, *(lv for lv in plan.levels if lv is not first)]
    for lv in order:
        rest = [m for m in lv.members if m not in exclude]
        if not rest:
            continue
        if len(rest) == 1:
            return rest[0]
        i = int(random() * len(rest))
        j = int(random() * (len(rest) - 1))
        if j >= i:
            j += 1
        a, b = rest[i], rest[j]
        ca, cb = a.core, b.core
        sa = (ca.in_flight + ca.load * LOAD_GAIN + ca.server) / a.weight
        sb = (cb.in_flight + cb.load * LOAD_GAIN + cb.server) / b.weight
        return a if sa <= sb else b
    return None


def pick_sticky(plan: Plan, key: int, exclude: Collection[Candidate] = ()) -> Candidate | None:
    """The member `key` maps to: the level by the key's own bits, then weighted rendezvous
    hashing (highest `weight / -ln(u)`, `u` from the key and the member) within it."""
    if not plan.levels:
        return None
    first = _choose_level(plan, _unit(mix(key, 0x5EED)))
    for lv in [first, *(lv for lv in plan.levels if lv is not first)]:
        best: Candidate | None = None
        best_score = -1.0
        for m in lv.members:
            if m in exclude:
                continue
            s = m.weight / -math.log(_unit(mix(key, m.hash_key)))
            if s > best_score:
                best, best_score = m, s
        if best is not None:
            return best
    return None


def split_sticky(weights: Sequence[float], key: int) -> int | None:
    """Index of the backend `key` falls in, by its position within the cumulative weights (the
    same key keeps its backend while the weights stay)."""
    total = sum((w for w in weights if w > 0), 0.0)
    if total <= 0:
        return None
    x = _unit(mix(key, 0xC0FFEE)) * total
    run = 0.0
    last = None
    for i, w in enumerate(weights):
        if w <= 0:
            continue
        run += w
        last = i
        if x < run:
            return i
    return last


def hash_key(text: str) -> int:
    """A stable 64-bit hash (the same in every process and replica, unlike `hash()`)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def mix(a: int, b: int) -> int:
    """splitmix64 finaliser of `a ^ b`: a well-spread 64-bit value."""
    z = ((a ^ (b * 0x9E3779B97F4A7C15)) + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _unit(h: int) -> float:
    """A 64-bit hash as a float in (0, 1) (never 0: it goes into a logarithm)."""
    return ((h >> 11) + 0.5) / float(1 << 53)
