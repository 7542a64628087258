"""(compiled) Per-rule and per-pool runtime state of the limiter (what outlives a reload).

`RuleState` holds one rule's keys (bounded LRU: `max_keys`; a key forgotten leaves the keys to
report and the leased ones too, unless it holds a share, see `RuleState.evict`), its local
scale, the keys the next sync must report, its decision counters and the peak signals of the
current second. `PoolState` holds a backend pool's adaptive concurrency limit and its colour.
Both are plain containers: the decisions are `gateway.core`'s, the I/O is the sync loop's.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from gateway.core.concurrency import GradientLimit, LimitParams
from gateway.core.keystate import KeyState, RuleMath
from gateway.core.overload import Colour, ColourMachine, Thresholds, step
from gateway.ratelimit.compiled import CompiledRule

POOL_DWELL_S: Final = 0.5

# Decision counters, by index (flushed into sluice_ratelimit_decisions_total every second).
DECISIONS: Final = (
    "admit", "reject_qps", "reject_tokens", "reject_pressure", "shed_yellow", "shed_red",
    "shadow_reject", "shadow_shed", "queued", "strict_fallback", "token_cut",
)  # fmt: skip
ADMIT: Final = 0
REJECT_QPS: Final = 1
REJECT_TOKENS: Final = 2
REJECT_PRESSURE: Final = 3
SHED_YELLOW: Final = 4
SHED_RED: Final = 5
SHADOW_REJECT: Final = 6
SHADOW_SHED: Final = 7
QUEUED: Final = 8
STRICT_FALLBACK: Final = 9
TOKEN_CUT: Final = 10


class RuleState:
    __slots__ = (
        "rule", "math", "keys", "max_keys", "scale", "dirty", "leased", "counts", "flushed",
        "peak_q", "peak_t", "shown", "hot", "evicted", "tokens", "min_tokens",
    )  # fmt: skip

    def __init__(self, rule: CompiledRule, max_keys: int, scale: float) -> None:
        self.rule = rule
        self.math: RuleMath = rule.math
        self.keys: OrderedDict[str, KeyState] = OrderedDict()
        self.max_keys = max_keys
        self.scale = scale  # share of the limits decided locally (1/workers, 1/replicas)
        self.dirty: dict[str, KeyState] = {}  # touched since the last sync (Redis only)
        self.leased: dict[str, KeyState] = {}  # keys holding a share
        self.counts = [0] * len(DECISIONS)
        self.flushed = [0] * len(DECISIONS)
        self.peak_q = 0.0  # highest signals seen since the last flush
        self.peak_t = 0.0
        self.shown = (0.0, 0.0)  # the peaks of the last full second (for state())
        self.hot: dict[str, KeyState] = {}  # keys that are not green
        self.evicted = 0
        self.tokens = [0.0, 0.0, 0.0]  # reserved, refunded, charged beyond the reservation
        self.min_tokens = 1024.0  # a typical reservation (the smallest token share asked)

    def key(self, k: str, now: float) -> KeyState:
        keys = self.keys
        ks = keys.get(k)
        if ks is None:
            ks = keys[k] = KeyState(self.math, self.scale, now, k)
            while len(keys) > self.max_keys:  # (a reload may have lowered the bound)
                self.evict()
        else:
            keys.move_to_end(k)
        return ks

    def evict(self) -> None:
        """Forget the least recently used key: it comes back, if it does, as a new key (full
        bucket, empty window, green). What it counted and has not reported yet goes with it,
        unless it holds a leased share: then it stays for the sync that gives the share back
        (the leases are dropped anyway when Redis goes away), so that neither `dirty` nor
        `leased` grows with the keys a long Redis outage sees."""
        old, ks = self.keys.popitem(last=False)
        self.evicted += 1
        self.hot.pop(old, None)
        if not ks.leased:
            if self.dirty.get(old) is ks:
                del self.dirty[old]
            if self.leased.get(old) is ks:
                del self.leased[old]

    def recolour(self, k: str, ks: KeyState) -> None:
        """Keep `hot` in step after `ks` changed colour."""
        if ks.colour is Colour.GREEN:
            self.hot.pop(k, None)
        else:
            self.hot[k] = ks

    def colours(self) -> tuple[int, int, int]:
        y = sum((1 for ks in self.hot.values() if ks.colour is Colour.YELLOW), 0)
        r = len(self.hot) - y
        return len(self.keys) - len(self.hot), y, r


class PoolState:
    """One backend pool: the adaptive concurrency limit and the colour it drives."""

    __slots__ = ("name", "limit", "machine", "thresholds", "room")

    def __init__(self, name: str, params: LimitParams, th: Thresholds, now: float) -> None:
        self.name = name
        self.limit = GradientLimit(params, now)
        self.machine = ColourMachine(now)
        self.thresholds = th
        self.room = 0  # an admission queue's `max_queued` in front of the limit (0: none)

    def observe(self, now: float) -> Colour | None:
        """Move the colour from the utilisation (the one signal stands for both): in flight
        (waiting in an admission queue included) ÷ (the limit + the queue's room), so that a
        queued pool turns yellow and red as its queue fills, not as soon as its slots are all
        busy. In flight moves with every request, so a pool steps *down* only after holding its
        colour for `POOL_DWELL_S`; it steps up at once."""
        lim = self.limit
        u = lim.in_flight / (lim.limit + self.room) if self.room else lim.utilisation
        m = self.machine
        band = self.thresholds.band(u, u)
        if step(m.colour, band) < m.colour and now - m.since < POOL_DWELL_S:
            return None
        return m.update(band, now)
