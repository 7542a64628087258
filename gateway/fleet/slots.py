"""Backend slots (`max_in_flight`) shared by the fleet: the leases of every pool, one owner in
the services (key `SLOTS`).

With a fleet store, a pool's `max_in_flight` × members is what the member runs for all replicas
together. Each replica's admission queue dispatches into the slots it *holds*: leased per pool
from the store (`lua/slots.lua`) by a background task, never by a request. The rules (what to
ask for, the fair share, what to give back, when to sync, the fallback share) are
`gateway.core.slots`'; this module moves them: it measures each queue (busy, waiting), runs one
pipelined round trip for every pool due, and resizes the queues.

Modes follow the fleet store's: `shared` (grants from the store), `fallback` (the store is
away: the pool's total ÷ live replicas, last known, and back to leases by itself once the
store answers: the first grant is at most that share, then grows as the store allows).
Without a fleet store there are no leases: the queue takes its process's share as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import TYPE_CHECKING, Any, Final

from gateway.core import slots as rules
from gateway.errors import StoreUnavailable
from gateway.fleet.store import REBIRTH_S, FleetStore, Script, fleet_for, nap
from gateway.services import ServiceKey, Services
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.admission.owner import PoolQueue

log = logging.getLogger("sluice.fleet")

SLOTS_LUA = Script.file("slots.lua")
SERVED_LUA = Script.file("served.lua")
SERVED_SYNC_S = 0.25  # how often the tenants' served tokens are merged through the store
SERVED_TTL_S = 3600  # a pool's fleet counters live this long after their last update
MAX_TENANTS_PER_SYNC = 1000  # per pool and sync (the most recently active first: the rest wait)
MAX_POOLS_PER_SYNC = 500  # pools synced in one round trip; the rest at the next tick


class SlotLease:
    """One pool's lease, as this replica knows it."""

    __slots__ = ("book", "name", "pq", "total", "grant", "held", "fleet_held", "fleet_in_use",
                 "target", "contended", "asked", "peak", "next_at", "backoff", "synced_at",
                 "syncs", "seen", "remote", "__weakref__")  # fmt: skip

    def __init__(self, book: SlotBook, name: str, pq: PoolQueue, total: int) -> None:
        self.book = book
        self.name = name
        self.pq = pq
        self.total = total
        self.grant = 0  # what the queue may dispatch into (shared mode)
        self.held = 0  # what the store counts for this replica (max(in use, grant))
        self.fleet_held = 0
        self.fleet_in_use = 0
        self.target = 0
        self.contended = False
        self.asked = 0  # the want of the last sync
        self.peak = 0  # the most wanted at a tick since the last sync
        self.next_at: float | None = 0.0  # 0: at the next tick
        self.backoff = 1
        self.synced_at = 0.0
        self.syncs = 0
        # Fair admission across the fleet: per (class, tenant), (its tokens served here, the
        # fleet's total) at the last merge; `remote`: tokens charged for service elsewhere.
        self.seen: dict[tuple[int, str], tuple[float, float]] = {}
        self.remote = 0.0

    def set_total(self, total: int, now: float) -> None:
        """The pool's slots for the whole fleet changed (members came or went)."""
        if total != self.total:
            self.total = total
            self.next_at = 0.0
            self.book.apply(self, now)

    def poke(self) -> None:
        """A request waits: sync before the next tick if the demand is worth it."""
        self.book.poke()

    def capacity(self) -> int:
        fleet = self.book.fleet
        if fleet.mode == "shared":
            return self.grant
        return rules.fallback_share(self.total, fleet.replicas)


class SlotBook:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.now = services.clock.now
        self.fleet: FleetStore = fleet_for(services)
        self.leases: dict[str, SlotLease] = {}
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.mode = self.fleet.mode
        self._orphans: list[SlotLease] = []  # dropped pools whose slots go back at the next sync
        self.ops = 0  # pool syncs sent to the store (script calls)
        self.round_trips = 0
        self.fleet.on_mode(self._mode_changed)
        self.fleet.views["pools"] = self.rows  # /admin/state: `fleet.pools`

    # -- attaching pools ----------------------------------------------------------------------
    def attach(self, pq: PoolQueue, total: int) -> SlotLease:
        """Lease the slots of `pq` (its fleet-wide `total`) from now on."""
        lease = self.leases.get(pq.name)
        if lease is None or lease.pq is not pq:
            lease = self.leases[pq.name] = SlotLease(self, pq.name, pq, total)
            if self.fleet.mode == "fallback":
                lease.grant = rules.fallback_share(total, self.fleet.replicas)
        lease.total = total
        pq.lease = lease
        self.apply(lease, self.now())
        if self.task is None or self.task.done():
            loop = self._loop()
            try:
                self.task = self.services.spawn(loop, "sluice-fleet-slots")
            except RuntimeError:  # no running loop (a chain activated offline): nothing to run
                loop.close()
                self.task = None
        self.wake.set()
        return lease

    def keep(self, names: set[str]) -> None:
        """Pools no policy leases any more: give their slots back (the loop's next sync)."""
        for name in [n for n in self.leases if n not in names]:
            lease = self.leases.pop(name)
            if lease.pq.lease is lease:
                lease.pq.lease = None
            self._orphans.append(lease)
            self.wake.set()

    def apply(self, lease: SlotLease, now: float) -> None:
        lease.pq.set_slots(lease.capacity(), now)

    def poke(self) -> None:
        if not self.wake.is_set():
            self.wake.set()

    def _mode_changed(self, mode: str) -> None:
        now = self.now()
        for lease in self.leases.values():
            if mode == "shared" and self.mode != "shared":
                # Back from fallback: keep using at most the fallback share until the store
                # grants more (its state may be gone; it re-learns every replica's use).
                share = rules.fallback_share(lease.total, self.fleet.replicas)
                lease.grant = min(lease.grant, share)
                lease.next_at = 0.0
            self.apply(lease, now)
        if mode != self.mode:
            self.mode = mode
            self.wake.set()

    # -- the background loop ------------------------------------------------------------------
    async def _loop(self) -> None:
        last_gauges = last_served = 0.0
        while not self.services.closed:
            interval = self.fleet.interval_s
            await nap(self.wake, interval)
            self.wake.clear()
            if self.fleet.shared and (self.leases or self._orphans):
                await self.sync_once()
                if self.now() - last_served >= SERVED_SYNC_S and self.fleet.shared:
                    last_served = self.now()
                    await self.sync_served()
                # never closer than a fifth of the interval (a burst of pokes is one sync)
                await asyncio.sleep(interval / 5)
            now = self.now()
            if now - last_gauges >= 1.0:
                last_gauges = now
                self.gauges()

    async def sync_once(self) -> int:
        """One round trip for every pool due; returns how many were synced."""
        fleet = self.fleet
        now = self.now()
        interval = fleet.interval_s
        ttl = rules.lease_ttl(interval)
        # While the store's fleet state is younger than this, replicas that have not
        # reconnected yet may still run their fallback share: grants are capped at it.
        capped_until = fleet.born + REBIRTH_S if fleet.born else 0.0
        todo: list[tuple[SlotLease, int, int]] = []
        cmds: list[tuple[list[str], list[Any]]] = []
        orphans, self._orphans = self._orphans, []
        for lease in [*self.leases.values(), *orphans]:
            if len(cmds) >= MAX_POOLS_PER_SYNC:
                break
            q = lease.pq.q
            busy = q.busy
            gone = lease in orphans
            # The most it wanted at any tick since the last sync: a closed-loop client's next
            # request comes a few ms after its last ended, and a slot given back in that gap
            # would come back only after a round of syncs.
            w = 0 if gone else max(rules.want(busy, q.waiting, lease.total), lease.peak)
            lease.peak = w
            due = lease.next_at is not None and now >= lease.next_at
            if not due and not rules.due_now(w, lease.asked, lease.grant, lease.target,
                                             lease.contended):  # fmt: skip
                continue
            lease.asked = w
            lease.peak = 0
            todo.append((lease, busy, w))
            cmds.append((
                [fleet.key("slots", lease.name)],
                [fleet.replica_id, lease.total, busy, w, ttl, capped_until, fleet.replicas],
            ))  # fmt: skip
        if not cmds:
            return 0
        try:
            replies = await fleet.pipeline(SLOTS_LUA, cmds, op="slots")
        except StoreUnavailable:
            self._orphans += [lz for lz, _, _ in todo if lz in orphans]
            return 0  # the fleet store is in fallback now: _mode_changed resized the queues
        self.round_trips += 1
        self.ops += len(cmds)
        now = self.now()
        for (lease, _busy, w), reply in zip(todo, replies, strict=True):
            g, held, fleet_held, fleet_in_use, target, contended = (int(x) for x in reply)
            r = rules.Reply(g, held, fleet_held, fleet_in_use, target, bool(contended))
            lease.grant, lease.held, lease.target = g, held, target
            lease.fleet_held, lease.fleet_in_use, lease.contended = (
                fleet_held,
                fleet_in_use,
                r.contended,
            )
            lease.synced_at = now
            lease.syncs += 1
            lease.next_at, lease.backoff = rules.next_sync(now, interval, ttl, w, r, lease.backoff)
            if lease in orphans:
                if held > 0:
                    self._orphans.append(lease)  # slots still in use: report again
                continue
            if self.fleet.shared:
                self.apply(lease, now)
        return len(cmds)

    async def sync_served(self) -> int:
        """Merge every active tenant's served tokens with the fleet's (one round trip for all
        pools): what other replicas served a tenant since the last merge is charged to its
        counter here (`FairQueue.charge`), so it is charged once for the whole fleet."""
        fleet = self.fleet
        cmds: list[tuple[list[str], list[Any]]] = []
        refs: list[tuple[SlotLease, list[tuple[tuple[int, str], float, float]]]] = []
        for lease in self.leases.values():
            q = lease.pq.q
            rows: list[tuple[tuple[int, str], float, float]] = []
            args: list[Any] = [SERVED_TTL_S]
            live: set[tuple[int, str]] = set()
            for cls, cq in q.classes.items():
                for key, t in cq.tenants.items():
                    ck = (cls, key)
                    live.add(ck)
                    seen = lease.seen.get(ck)
                    here = seen[0] if seen is not None and seen[0] <= t.served else 0.0
                    d = t.served - here
                    if (not t.live and not t.in_flight and d <= 0.0) or len(
                        rows
                    ) >= MAX_TENANTS_PER_SYNC:
                        continue
                    rows.append((ck, t.served, d))
                    args += [_field(cls, key), d]
            for ck in [k for k in lease.seen if k not in live]:
                del lease.seen[ck]  # a tenant record the queue dropped
            if rows:
                cmds.append(([fleet.key("served", lease.name)], args))
                refs.append((lease, rows))
        if not cmds:
            return 0
        try:
            replies = await fleet.pipeline(SERVED_LUA, cmds, op="served")
        except StoreUnavailable:
            return 0
        self.ops += len(cmds)
        for (lease, rows), reply in zip(refs, replies, strict=True):
            for (ck, served, d), total_ in zip(rows, reply, strict=True):
                total = float(total_)
                prev = lease.seen.get(ck)
                if prev is not None:
                    remote = total - prev[1] - d
                    if remote > 0.0:
                        lease.pq.q.charge(ck[0], ck[1], remote)
                        lease.remote += remote
                lease.seen[ck] = (served, total)
        return len(cmds)

    # -- status -------------------------------------------------------------------------------
    def gauges(self) -> None:
        for lease in self.leases.values():
            g = metrics.FLEET_SLOTS
            g.labels(lease.name, "held").set(lease.capacity())
            g.labels(lease.name, "in_flight").set(lease.pq.q.busy)
            g.labels(lease.name, "fleet_in_flight").set(lease.fleet_in_use)
            g.labels(lease.name, "capacity").set(lease.total)

    def readiness(self) -> dict[str, Any]:
        return {"mode": self.fleet.mode, "pools": len(self.leases)}

    def rows(self) -> list[dict[str, Any]]:
        """One row per leased pool, for `/admin/state`'s `fleet.pools`."""
        now = self.now()
        mode = self.fleet.mode
        return [
            {
                "pool": lz.name,
                "mode": mode,
                "capacity": lz.total,  # the fleet's: max_in_flight × members
                "slots_here": lz.capacity(),
                "in_flight_here": lz.pq.q.busy,
                "waiting_here": lz.pq.q.waiting,
                "held_in_store": lz.held,
                "fleet_held": lz.fleet_held,
                "fleet_in_flight": lz.fleet_in_use,
                "fair_target": lz.target,
                "live_replicas": self.fleet.replicas,
                "syncs": lz.syncs,
                "tokens_charged_elsewhere": round(lz.remote),
                "synced_ago_s": round(now - lz.synced_at, 2) if lz.synced_at else None,
            }
            for lz in self.leases.values()
        ]

    async def aclose(self) -> None:
        """Give every held slot back (bounded by the store's deadline)."""
        if not self.fleet.shared:
            return
        cmds = [
            ([self.fleet.key("slots", lz.name)],
             [self.fleet.replica_id, lz.total, 0, 0, 1.0, 0.0, self.fleet.replicas])
            for lz in self.leases.values() if lz.held > 0
        ]  # fmt: skip
        if not cmds:
            return
        try:
            await self.fleet.pipeline(SLOTS_LUA, cmds, op="slots")
        except StoreUnavailable as exc:
            log.info("fleet slots: could not give slots back at stop: %s", exc)


def _field(cls: int, key: str) -> str:
    """A tenant's field in the store: its class and a digest of its key (no client text)."""
    return f"{cls}|{hashlib.sha256(key.encode()).hexdigest()[:20]}"


SLOTS: Final = ServiceKey[SlotBook]("fleet_slots")


def slots_for(services: Services) -> SlotBook:
    return services.get(SLOTS, lambda: SlotBook(services))
