"""The in-process twin of `lua/bucket.lua` and `lua/announce.lua`: the same arithmetic on a
dict, for the contract suite and for a single process that wants the store interface.

Bounded: at most `max_keys` keys (least recently used go first), and a key idle for two
epochs is forgotten, as its Redis hash would expire.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from gateway.store.base import EPOCH_S, SyncOp, SyncResult


class _State:
    __slots__ = ("w", "c", "p", "oc", "op", "t", "u", "born")

    def __init__(self, burst: float, now: float) -> None:
        self.w = -1
        self.c = self.p = self.oc = self.op = 0.0
        self.t = burst
        self.u = now
        self.born = now


class MemoryStore:
    name = "memory"

    def __init__(self, clock: Callable[[], float] = time.time, max_keys: int = 1_000_000) -> None:
        self._clock = clock
        self._keys: OrderedDict[str, _State] = OrderedDict()
        self._replicas: dict[str, float] = {}
        self.max_keys = max_keys

    def _state(self, key: str, burst: float, now: float) -> _State:
        s = self._keys.get(key)
        if s is not None and now - s.u > 2 * EPOCH_S:
            s = None  # would have expired in Redis
        if s is None:
            s = self._keys[key] = _State(burst, now)
            if len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        return s

    def apply(self, op: SyncOp, now: float) -> SyncResult:
        prm = op.params
        limit, window, rate, burst = prm.limit, prm.window_s, prm.rate, prm.burst
        s = self._state(op.key, burst, now)
        pos = now / window
        idx = math.floor(pos)
        if idx != s.w:
            if idx == s.w + 1:
                s.p, s.op = s.c, s.oc
            else:
                s.p = s.op = 0.0
            s.c = s.oc = 0.0
            s.w = idx
        f = 1.0 - (pos - idx)
        if rate > 0 and now > s.u:
            s.t = min(burst, s.t + (now - s.u) * rate)
        if now > s.u:
            s.u = now
        s.c += op.req_delta
        if s.c < 0:
            s.p = max(0.0, s.p + s.c)
            s.c = 0.0
        s.oc += op.offered
        s.t = max(-burst, min(burst, s.t + op.tok_delta))
        if op.reset and s.t < 0:
            s.t = 0.0
        gr = gt = 0.0
        adm = s.p * f + s.c
        if op.strict:
            ok = not (limit > 0 and adm + 1 > limit) and not (rate > 0 and s.t <= 0)
            if ok:
                q = adm / limit if limit > 0 else 0.0
                tu = min(1.0, 1.0 - s.t / burst) if rate > 0 else 0.0
                ok = prm.wq * q + prm.wt * tu < prm.admit_below
            if ok:
                s.c += 1
                gr = 1.0
                if rate > 0 and op.want_tok > 0:
                    s.t = max(-burst, s.t - op.want_tok)
                    gt = op.want_tok
        else:
            if limit > 0 and op.want_req > 0:
                gr = max(0.0, min(op.want_req, math.floor(limit - adm)))
                s.c += gr
            if rate > 0 and op.want_tok > 0 and s.t > 0:
                gt = min(op.want_tok, s.t)
                s.t -= gt
        return SyncResult(gr, gt, s.p * f + s.c, s.op * f + s.oc, s.t, now)

    async def sync(self, ops: Sequence[SyncOp]) -> list[SyncResult]:
        now = self._clock()
        return [self.apply(op, now) for op in ops]

    async def take(self, op: SyncOp) -> SyncResult:
        return self.apply(op, self._clock())

    async def announce(self, replica: str, ttl_s: float) -> int:
        now = self._clock()
        self._replicas[replica] = now
        for r in [r for r, t in self._replicas.items() if t < now - ttl_s]:
            del self._replicas[r]
        return len(self._replicas)

    async def leave(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    async def ping(self) -> bool:
        return True

    async def connect(self, timeout_s: float) -> None:
        return None

    async def aclose(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
