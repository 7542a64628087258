"""(compiled) One limit key on this replica: its window and bucket, its leased shares, its colour.
Pure.

A key decides in one of two ways, always locally and without waiting:

- *local* (the memory store; and a Redis rule that has no lease yet, or whose Redis is away):
  against its own window and bucket, both sized by `scale` (1/N of the rule's limits: N is the
  number of worker processes for the memory store, the number of live replicas for a Redis
  fallback);
- *leased* (a Redis rule): against shares of the global limits the sync loop leased for it.
  `req_share` requests and `tok_share` tokens are already counted in the global state; when a
  share is used up the key may still admit as long as the global picture of the last sync,
  minus what this replica took beyond its share, has room; what it took beyond is charged at
  the next sync. The overshoot is bounded by what the replicas take beyond their shares
  between two syncs.

Each request updates the offered count (demand), the colour (from the offered QPS utilisation
and the token utilisation, see `gateway.core.overload`; a rule with one limit has one signal
and the other reads 0, so its keys turn yellow but never red), then decides: admit while
pressure < `admit_below`, the window has room for this request and the bucket is not empty.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.core.limiter import Bucket, Window
from gateway.core.overload import NEXT_COLOUR, Colour, Thresholds
from gateway.core.pressure import Weights


@dataclass(frozen=True, slots=True)
class RuleMath:
    """A rule's numbers, as the decisions use them (built once per policy)."""

    limit: float  # requests per window; 0 = no request limit
    window_s: float
    rate: float  # tokens per second; 0 = no token limit
    burst: float
    weights: Weights
    admit_below: float = 0.95
    thresholds: Thresholds = Thresholds()

    @property
    def has_q(self) -> bool:
        return self.limit > 0.0

    @property
    def has_t(self) -> bool:
        return self.rate > 0.0

    @classmethod
    def of(
        cls,
        qps: float | None,
        window_s: float,
        rate: float | None,
        burst: float | None,
        wq: float = 0.6,
        wt: float = 0.4,
        admit_below: float = 0.95,
        thresholds: Thresholds | None = None,
    ) -> RuleMath:
        # The window holds at least one request (qps 0.5 means one request per 2 s).
        window = max(window_s, 1.0 / qps) if qps else window_s
        limit = qps * window if qps else 0.0
        r = rate or 0.0
        b = (burst if burst is not None else r) if r else 0.0
        return cls(
            limit,
            window,
            r,
            b,
            Weights.of(wq, wt, limit > 0.0, r > 0.0),
            admit_below,
            thresholds or Thresholds(),
        )


class Code(enum.IntEnum):
    ADMIT = 0
    QPS = 1  # the window is full
    TOKENS = 2  # the token bucket is empty
    PRESSURE = 3  # the weighted score reached admit_below


class KeyState:
    __slots__ = (
        "win", "bucket", "colour", "since", "changed", "q", "t", "last",
        "leased", "req_share", "tok_share", "g_adm", "g_off", "g_tok",
        "off_since", "adm_unleased", "tok_unleased", "tok_used", "reset", "rkey", "name",
    )  # fmt: skip

    def __init__(self, m: RuleMath, scale: float, now: float, name: str = "") -> None:
        self.name = name  # the key's value (what the rule's key parts made of the request)
        self.win = Window(m.window_s)
        self.bucket = Bucket(m.burst * scale, now)
        self.colour = Colour.GREEN
        self.since = now  # when the colour was entered
        self.changed: Colour | None = None  # the colour left, when the last request moved it
        self.q = 0.0  # last offered QPS utilisation seen
        self.t = 0.0  # last token utilisation seen
        self.last = now  # last use (idle keys give their lease back)
        # Leasing (Redis rules); see the module docstring.
        self.leased = False
        self.req_share = 0.0
        self.tok_share = 0.0
        self.g_adm = 0.0  # global admitted estimate in the window, as of the last sync
        self.g_off = 0.0  # global offered estimate, as of the last sync
        self.g_tok = m.burst  # global tokens available, as of the last sync
        self.off_since = 0.0  # offered here since the last sync (reported)
        self.adm_unleased = 0.0  # admitted here without a lease (charged at the next sync)
        self.tok_unleased = 0.0  # tokens net of refunds taken without a lease (charged)
        self.tok_used = 0.0  # tokens reserved since the last sync (the next lease's size)
        self.reset = False  # red was entered: the store forgives the debt at the next sync
        self.rkey: str | None = None  # the store's key, built on first sync

    # -- the request phase --------------------------------------------------------------------
    def request(self, m: RuleMath, scale: float, now: float) -> Code:
        """Count an arrival, move the colour, decide; an admitted request is counted."""
        self.last = now
        w = self.win
        pos = now / w.size
        idx = int(pos)
        if idx != w.idx:
            w.roll(now)
        f = 1.0 - (pos - idx)
        w.ocur += 1.0
        self.off_since += 1.0
        has_q = m.limit > 0.0
        has_t = m.rate > 0.0
        if self.leased:
            limit = m.limit
            # The global count holds every share leased, ours too: what this replica has not
            # used yet is not load (and what it took beyond its share is).
            adm = self.g_adm - self.req_share
            off = self.g_off + self.off_since
            tok = self.g_tok + self.tok_share
            burst = m.burst
        else:
            limit = m.limit * scale
            adm = w.prev * f + w.cur
            off = w.oprev * f + w.ocur
            burst = m.burst * scale
            tok = self.bucket.level(m.rate * scale, burst, now) if has_t else 0.0
        q = off / limit if has_q else 0.0
        t = 1.0 - tok / burst if has_t else 0.0
        self.q, self.t = q, t
        # The colour (a rule with one limit has one signal, the other is 0).
        th = m.thresholds
        hi, lo = (q, t) if q >= t else (t, q)
        if hi < th.green_below:
            band = 0
        elif hi <= th.yellow_above:
            band = 1
        elif lo > th.red_above:
            band = 4
        elif lo > th.yellow_above:
            band = 3
        else:
            band = 2
        old = self.colour
        new = NEXT_COLOUR[old * 5 + band]
        if new is not old:
            self.colour, self.since, self.changed = new, now, old
            if new is Colour.RED:
                self._reset()
        else:
            self.changed = None
        # The decision.
        if has_q:
            if self.leased:
                # Beyond its share a replica may take only its part (`scale`, 1 / live
                # replicas) of the room the last sync saw: every replica sees the same room, and
                # taking all of it each is how N replicas passed the limit together.
                if self.req_share < 1.0 and 1.0 - self.req_share > (limit - self.g_adm) * scale:
                    return Code.QPS
            elif adm + 1.0 > limit:
                return Code.QPS
        if has_t and tok <= 0.0:
            return Code.TOKENS
        wts = m.weights
        tu = t if t < 1.0 else 1.0
        if wts.q * (adm / limit if has_q else 0.0) + wts.t * tu >= m.admit_below:
            return Code.PRESSURE
        w.cur += 1.0
        if self.leased:
            self.req_share -= 1.0
        else:
            self.adm_unleased += 1.0
        return Code.ADMIT

    def unoffer(self) -> None:
        """Forget the arrival of a request that is decided again (the yellow queue)."""
        if self.win.ocur >= 1.0:
            self.win.ocur -= 1.0
        if self.off_since >= 1.0:
            self.off_since -= 1.0

    def undo(self) -> None:
        """An admitted request was refused by a later phase: give its admission back."""
        self.win.unadmit()
        if self.leased:
            self.req_share += 1.0
        elif self.adm_unleased >= 1.0:
            self.adm_unleased -= 1.0

    def retry_after(self, m: RuleMath, scale: float, now: float, code: Code) -> float:
        """Seconds after which a request refused with `code` may succeed (an estimate)."""
        if code is Code.TOKENS:
            if self.leased:
                return max(0.0, -(self.g_tok + self.tok_share)) / m.rate + 0.001
            return self.bucket.retry_after(m.rate * scale, m.burst * scale, now)
        if code is Code.QPS and not self.leased:
            return self.win.retry_after(now, m.limit * scale)
        return min(m.window_s, 1.0) / 2 if m.limit else 1.0

    # -- the body phase: tokens ---------------------------------------------------------------
    def reserve(self, m: RuleMath, scale: float, now: float, cost: float) -> bool:
        """Take `cost` tokens if the bucket (or the leased picture) is not empty."""
        self.last = now
        if self.leased:
            if self.g_tok + self.tok_share <= 0.0:
                return False
            self.tok_share -= cost
        else:
            if not self.bucket.take(m.rate * scale, m.burst * scale, now, cost):
                return False
            self.tok_unleased += cost
        self.tok_used += cost
        return True

    def settle(self, m: RuleMath, scale: float, diff: float) -> None:
        """Give back (diff > 0) or charge (diff < 0) the difference between a reservation and
        the real usage."""
        if self.leased:
            self.tok_share += diff
        else:
            self.bucket.add(diff, m.burst * scale)
            self.tok_unleased -= diff

    def tokens_left(self, m: RuleMath, scale: float, now: float) -> float:
        if self.leased:
            return self.g_tok + self.tok_share
        return self.bucket.level(m.rate * scale, m.burst * scale, now)

    def requests_left(self, m: RuleMath, scale: float, now: float) -> float:
        if self.leased:
            return max(0.0, m.limit - self.g_adm + self.req_share)
        return max(0.0, m.limit * scale - self.win.admitted(now))

    def observe(self, m: RuleMath, scale: float, now: float) -> bool:
        """Move the colour of a key that gets no requests (its demand went away); counts
        nothing. True if the colour changed (`changed` holds the one it left)."""
        has_q, has_t = m.limit > 0.0, m.rate > 0.0
        if self.leased:
            off, tok, limit, burst = self.g_off, self.g_tok + self.tok_share, m.limit, m.burst
        else:
            off, limit, burst = self.win.offered(now), m.limit * scale, m.burst * scale
            tok = self.bucket.level(m.rate * scale, burst, now) if has_t else 0.0
        q = off / limit if has_q else 0.0
        t = 1.0 - tok / burst if has_t else 0.0
        self.q, self.t = q, t
        old = self.colour
        new = NEXT_COLOUR[old * 5 + m.thresholds.band(q, t)]
        if new is old:
            return False
        self.colour, self.since, self.changed = new, now, old
        if new is Colour.RED:
            self._reset()
        return True

    def _reset(self) -> None:
        """Entering red: the token debt is written off here and, at the next sync, in the
        store (see `Bucket.forgive`)."""
        self.bucket.forgive()
        if self.tok_share < 0.0:
            self.tok_share = 0.0
        if self.tok_unleased > 0.0:
            self.tok_unleased = 0.0
        self.reset = True


def strict_seen(
    ks: KeyState,
    m: RuleMath,
    now: float,
    admitted: bool,
    g_adm: float,
    g_off: float,
    g_tok: float,
) -> None:
    """A `strict` rule's store decided for this request: count it locally (for the signals)
    and move the colour from the global picture the store returned."""
    ks.last = now
    w = ks.win
    w.roll(now)
    w.ocur += 1.0
    if admitted:
        w.cur += 1.0
    ks.g_adm, ks.g_off, ks.g_tok = g_adm, g_off, g_tok
    has_q, has_t = m.limit > 0.0, m.rate > 0.0
    q = g_off / m.limit if has_q else 0.0
    t = 1.0 - g_tok / m.burst if has_t else 0.0
    ks.q, ks.t = q, t
    old = ks.colour
    new = NEXT_COLOUR[old * 5 + m.thresholds.band(q, t)]
    ks.changed = old if new is not old else None
    if new is not old:
        ks.colour, ks.since = new, now
        if new is Colour.RED:
            ks._reset()
