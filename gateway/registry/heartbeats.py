"""Members from heartbeats in Redis: the key layout, publishing (the `sluice heartbeat` agent)
and the gateway's poller that keeps a backend's registry members current without a restart.

Layout, per service (the `{service}` hash tag keeps a service's keys in one Redis Cluster slot):

    sluice:hb:{SERVICE}:SID   hash  sid, addr (host:port), load (0-100), ver, ts (ns since epoch)
                              expires TTL seconds after the last heartbeat (default 5)
    sluice:hb:{SERVICE}       sorted set of SIDs, score = last heartbeat (s); entries whose hash
                              has expired are removed by the gateway

Freshness: a member is in rotation while the gateway has seen its `ts` change within
`stale_after_s` (golden: 5 s), measured on the gateway's own monotonic clock, so an agent's
clock skew cannot keep a dead member alive or hide a live one for more than one poll. A member
seen for the first time counts as fresh only if its `ts` is younger than `stale_after_s` by
Redis's clock (`TIME`). An expired hash removes the member at the next poll.

When Redis cannot be read, the last known members keep serving (nothing is judged stale until
the registry answers again); `sluice_registry_up` is 0 and `/admin/backends` says why.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.telemetry import metrics

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from gateway.policy.model import Registry
    from gateway.registry.member import MemberBooks
    from gateway.services import Services

log = logging.getLogger("sluice.registry")

KEY_PREFIX = "sluice:hb"
FIELDS = ("sid", "addr", "load", "ver", "ts")
_ADDR = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):[0-9]{1,5}$")
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
INDEX_TTL_S = 86_400  # a service nobody heartbeats any more leaves its index behind for a day


def index_key(service: str) -> str:
    return f"{KEY_PREFIX}:{{{service}}}"


def member_key(service: str, sid: str) -> str:
    return f"{KEY_PREFIX}:{{{service}}}:{sid}"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    sid: str
    addr: str
    load: float
    ver: str
    ts: int  # ns since the epoch


def parse(values: Sequence[bytes | str | None]) -> Heartbeat | None:
    """A heartbeat from its hash fields (in `FIELDS` order), or None if any is missing/invalid."""
    if len(values) != len(FIELDS) or any(v is None for v in values):
        return None
    sid, addr, load, ver, ts = (v.decode() if isinstance(v, bytes) else str(v) for v in values)
    if not _NAME.match(sid) or not _ADDR.match(addr) or len(ver) > 128:
        return None
    try:
        load_f = float(load)
        ts_i = int(ts)
    except ValueError:
        return None
    if not 0.0 <= load_f <= 100.0 or ts_i <= 0:
        return None
    port = int(addr.rpartition(":")[2])
    if not 0 < port < 65536:
        return None
    return Heartbeat(sid, addr, load_f, ver, ts_i)


async def publish(client: Redis, service: str, hb: Heartbeat, ttl_s: float) -> None:
    """Write one heartbeat (hash + TTL + index entry) atomically."""
    key = member_key(service, hb.sid)
    index = index_key(service)
    pipe = client.pipeline(transaction=True)
    pipe.hset(key, mapping={"sid": hb.sid, "addr": hb.addr, "load": f"{hb.load:.1f}",
                            "ver": hb.ver, "ts": str(hb.ts)})  # fmt: skip
    pipe.pexpire(key, max(1, int(ttl_s * 1000)))
    pipe.zadd(index, {hb.sid: hb.ts / 1e9})
    pipe.expire(index, INDEX_TTL_S)
    await pipe.execute()


async def withdraw(client: Redis, service: str, sid: str) -> None:
    """Remove a member at once (the agent's clean exit)."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(member_key(service, sid))
    pipe.zrem(index_key(service), sid)
    await pipe.execute()


async def read(client: Redis, service: str, max_members: int) -> tuple[int, list[Heartbeat]]:
    """Redis's time (ns) and the live heartbeats of `service` (newest first, at most
    `max_members`). Index entries whose hash expired are removed."""
    index = index_key(service)
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.zrevrange(index, 0, max_members - 1)
    now, sids = await pipe.execute()
    now_ns = int(now[0]) * 1_000_000_000 + int(now[1]) * 1000
    names = [s.decode() if isinstance(s, bytes) else str(s) for s in sids]
    if not names:
        return now_ns, []
    pipe = client.pipeline(transaction=False)
    for sid in names:
        pipe.hmget(member_key(service, sid), list(FIELDS))
    rows: list[Any] = await pipe.execute()
    out: list[Heartbeat] = []
    gone: list[str] = []
    for sid, row in zip(names, rows, strict=True):
        if row is None or all(v is None for v in row):
            gone.append(sid)
            continue
        hb = parse(row)
        if hb is not None and hb.sid == sid:
            out.append(hb)
    if gone:
        await client.zrem(index, *gone)
    return now_ns, out


class Watcher:
    """Polls one backend's registry every `poll_s`; `found` (address → sid, load, version) and
    `fresh_until` (address → monotonic deadline) are what the backend's views read. Shared by
    every view with the same `discovery.registry` section."""

    source = "registry"

    def __init__(self, services: Services, pool: MemberBooks, backend: str, reg: Registry) -> None:
        self.services = services
        self.pool = pool
        self.backend = backend
        self.reg = reg
        self.found: dict[str, Heartbeat] = {}
        self.fresh_until: dict[str, float] = {}
        self.up: bool | None = None  # None: not polled yet
        self.error = ""
        self.polled_at: float | None = None
        self._seen: dict[str, int] = {}  # sid → last ts read
        self.task: asyncio.Task[None] | None = None

    def placement(self, address: str) -> tuple[int, int]:
        """Weight and priority level of a member it found."""
        return self.reg.weight, self.reg.priority

    def _fresh(self, hb: Heartbeat, redis_now_ns: int) -> bool:
        last = self._seen.get(hb.sid)
        self._seen[hb.sid] = hb.ts
        if last is None:
            return redis_now_ns - hb.ts < self.reg.stale_after_s * 1e9
        return hb.ts != last

    async def poll_once(self) -> None:
        from gateway.store.redis_client import redis_for

        reg = self.reg
        client = redis_for(self.services, reg.redis, holder=self)
        try:
            async with asyncio.timeout(reg.timeout_s):
                redis_now, beats = await read(client, reg.service, reg.max_members)
        except Exception as e:  # Redis down, timeout, bad reply: keep the last members
            metrics.REGISTRY_POLLS.labels(self.backend, "error").inc()
            self.failed(f"{type(e).__name__}: {e}", self.services.clock.now())
            return
        metrics.REGISTRY_POLLS.labels(self.backend, "ok").inc()
        if reg.version is not None:
            beats = [b for b in beats if b.ver == reg.version]
        self.update(beats, redis_now, self.services.clock.now())

    def update(self, beats: list[Heartbeat], redis_now_ns: int, now: float) -> None:
        """A successful poll: members not in it leave; a heartbeat that changed (or is young
        when first seen) keeps its member fresh for `stale_after_s`."""
        stale_s = self.reg.stale_after_s
        found = {b.addr: b for b in beats}
        changed = found.keys() != self.found.keys()
        for b in beats:
            was = self.fresh_until.get(b.addr)
            if self._fresh(b, redis_now_ns) or was == math.inf:
                # (inf: kept while Redis was down; judged again from now on)
                self.fresh_until[b.addr] = now + stale_s
                changed = changed or was is None or was <= now
            elif was is None:
                self.fresh_until[b.addr] = now  # known, but its heartbeat is old
            core = self.pool.core(self.backend, b.addr)
            core.sid, core.version, core.load = b.sid, b.ver, b.load
        for addr in [a for a in self.fresh_until if a not in found]:
            del self.fresh_until[addr]
        live = {b.sid for b in beats}
        for sid in [s for s in self._seen if s not in live]:
            del self._seen[sid]
        self.found = found
        if self.up is not True:
            changed = True
        self.up, self.error, self.polled_at = True, "", now
        if changed:
            self.pool.changed()

    def failed(self, error: str, now: float) -> None:
        """Redis unreachable: the members live when it went away keep serving (their
        staleness is not judged while the registry cannot be read)."""
        if self.up is not False:
            log.warning("backend %s: registry unreachable, keeping %d members: %s",
                        self.backend, len(self.found), error)  # fmt: skip
        self.up, self.error = False, error[:200]
        for addr, until in self.fresh_until.items():
            if until > now:
                self.fresh_until[addr] = math.inf
        self.pool.changed()

    def state(self) -> dict[str, object]:
        return {"up": self.up, "error": self.error, "polled_at": self.polled_at,
                "members": len(self.found)}  # fmt: skip

    async def run(self) -> None:
        # Also ends by itself once the services close (a cancellation can be lost inside the
        # Redis client when it races the poll's own timeout).
        while not self.services.closed:
            await self.poll_once()
            await asyncio.sleep(self.reg.poll_s)

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = self.services.spawn(self.run(), f"registry:{self.backend}")

    def stop(self) -> None:
        from gateway.store.redis_client import release_redis

        if self.task is not None:
            self.task.cancel()
            self.task = None
        release_redis(self.services, self)
