"""The budgets' one owner in the services (key `BUDGETS`): every key's ledger, the store, the
sync loop, the operators' commands and what /admin/state shows.

- Without a store each process keeps its own tallies (with `--workers N`, 1/N of each budget),
  in memory: a restart forgets them. `sluice policy check` says so.
- With one (`store: {redis: ...}`), a key's ledger holds a share leased from the store; the
  request path reserves from it without waiting. The sync loop (`run`) reports settled usage,
  gives back idle share and leases more, for all active keys in one pipelined round trip every
  `sync_interval_ms`, at once when a request waits for a share (at most `wait_ms`).
- The store unreachable: `down`; each rule's `when_store_down` says whether a request its share
  cannot cover is admitted (tallied locally, reported when the store is back: nothing is
  lost) or refused with 503.

What a policy reload does: a rule whose identity (name, key parts, period) is unchanged keeps
its ledgers; any other change starts new tallies (the store keeps the old ones until their
period ends); a new amount applies at once; a removed rule's ledgers are reported and dropped.
A store added or removed starts new tallies here (a store's own tallies stay where they are);
a store moved to another URL: each key's next sync finds its lease unknown there and starts
over from nothing held.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import islice
from typing import Any, Final

from gateway.budgets.compiled import CompiledBudget, CompiledBudgets
from gateway.budgets.entries import Entry, RuleBook
from gateway.budgets.store import BudgetStore, Figures, Msg, Reply, expire_at, redis_key
from gateway.core.budgets import Ledger, crossed, share_plan, window
from gateway.errors import StoreUnavailable
from gateway.fleet.store import FleetStore, fleet_for
from gateway.policy.budgets import Budgets
from gateway.services import ServiceKey, Services
from gateway.telemetry import metrics

log = logging.getLogger("sluice.budgets")
audit = logging.getLogger("sluice.audit")

MAX_RETIRING = 10_000  # ledgers of ended periods or evicted keys still to report
BATCH = 200  # messages per pipelined round trip
IDLE_S = 2.0  # a key unused this long gives its free share back
STATE_KEYS = 20  # keys per rule in /admin/state (the most recently used)


class Book:
    def __init__(self, services: Services, wall: Callable[[], float] = time.time) -> None:
        self.services = services
        self.wall = wall
        self.mono = time.monotonic
        self.rules: dict[str, RuleBook] = {}  # by ident
        self.by_name: dict[str, RuleBook] = {}
        self.section: Budgets | None = None
        self.fleet: FleetStore = fleet_for(services)
        self.fleet.on_mode(self._mode_changed)
        self.store: BudgetStore | None = None
        self.last_error = ""
        self.workers = max(1, int(os.environ.get("SLUICE_WORKERS", "1") or 1))
        self.active: dict[int, Entry] = {}  # entries with something to tell the store
        self.retiring: list[Entry] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.interval_s = 0.1
        self.ttl_s = 30.0
        self.expired_total = 0

    # -- building and activating --------------------------------------------------------------
    def book(self, rule: CompiledBudget) -> RuleBook:
        rb = self.rules.get(rule.ident)
        if rb is None:
            rb = self.rules[rule.ident] = RuleBook(rule)
        return rb

    def activate(self, c: CompiledBudgets) -> None:
        self.section = c.section
        self.interval_s = c.section.sync_interval_ms / 1000
        self.ttl_s = c.section.reservation_ttl_s
        live = {r.ident: r for r in c.rules}
        for ident in [i for i in self.rules if i not in live]:
            for e in self.rules.pop(ident).entries.values():
                self._retire(e)
        for r in c.rules:
            rb = self.book(r)
            if rb.rule.tokens != r.tokens and not r.dynamic:  # a new amount applies at once
                for e in rb.entries.values():
                    if self.store is None:
                        e.ledger.adjust(r.tokens // self.workers)
                    else:
                        e.ledger.limit = r.tokens
            rb.rule = r
        self.by_name = {rb.rule.name: rb for rb in self.rules.values()}
        shared = self.fleet.mode != "none"
        if shared != (self.store is not None):  # a store added or removed: new tallies
            for rb in self.rules.values():
                for e in rb.entries.values():
                    self._retire(e)
                rb.entries.clear()
        if not shared:
            self.store = None
        elif self.store is None:
            self.store = BudgetStore(self.fleet, int(self.ttl_s * 1000))
        else:
            self.store.ttl_ms = int(self.ttl_s * 1000)
        metrics.BUDGET_STORE_UP.set(0 if self.down else 1)
        if self.store is not None and (self.task is None or self.task.done()):
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # a chain built offline: nothing to run, no coroutine made
                return
            self.task = self.services.spawn(self.run(), "sluice-budgets")

    @property
    def down(self) -> bool:
        """A store is configured and does not answer now (or has not yet)."""
        return self.store is not None and not self.fleet.shared

    def _mode_changed(self, mode: str) -> None:
        metrics.BUDGET_STORE_UP.set(0 if self.down else 1)
        if mode == "fallback":
            self._unreachable(self.fleet.last_error)
        self.wake.set()

    # -- the request path ---------------------------------------------------------------------
    def entry(self, rb: RuleBook, key: str, limit: int, now: float) -> Entry:
        """The key's entry for the period containing `now` (wall clock): a new period is a new
        ledger, the old one reported and dropped."""
        e = rb.entries.get(key)
        if e is not None and now < e.ledger.window.end:
            rb.entries.move_to_end(key)
            lg = e.ledger
            if self.store is None:
                lg.adjust(limit // self.workers)
            else:
                lg.limit = limit
            return e
        if e is not None:
            self._retire(e)
        rule = rb.rule
        win = window(rule.period, now)
        if self.store is None:
            lg = Ledger(limit // self.workers, win)
            rkey = ""
        else:
            lg = Ledger(limit, win, 0)
            rkey = redis_key(self.store.prefix, rule.ident, key, win.id)
        e = rb.entries[key] = Entry(key, lg, rkey, win.end - win.start)
        section = self.section
        if len(rb.entries) > (section.max_keys if section is not None else 100_000):
            for k, old in rb.entries.items():
                if old.ledger.reserved == 0 and old is not e:
                    del rb.entries[k]
                    self._retire(old)
                    break
        return e

    def target(self, e: Entry) -> int:
        """The free share a replica keeps of a key: `share_tokens`, else eight requests' worth,
        or more when the key is busy (twice what it used in one recent sync interval, so that
        a busy key syncs about once an interval), at most 1/16 of its budget."""
        s = self.section
        if s is not None and s.share_tokens is not None:
            return s.share_tokens
        per_request = (s.default_max_tokens if s is not None else 1024) + 512
        cap = max(e.ledger.limit, 16) // 16
        return max(1, min(cap, max(8 * per_request, 2 * e.flow)))

    def used(self, e: Entry) -> None:
        """A request reserved or settled on `e`: tell the store soon, sooner if the share runs
        low."""
        e.last_use = self.mono()
        if self.store is None:
            return
        e.dirty = True
        self.active[id(e)] = e
        if e.ledger.avail < e.low:
            self.wake.set()

    def deadline(self) -> float:
        """When a request that starts waiting for shares now must stop (`wait_ms`)."""
        s = self.section
        return self.mono() + (s.wait_ms if s is not None else 100.0) / 1000

    async def lease(self, e: Entry, need: int, deadline: float) -> bool:
        """Reserve `need` on `e`, waiting (until `deadline`, monotonic) for the sync loop to
        lease more while the local share cannot cover it. False (nothing reserved) when the
        store has no more to give, does not answer, or the wait ran out."""
        e.need += need
        self.active[id(e)] = e
        try:
            while True:
                if e.ledger.reserve(need):
                    return True
                if self.down:
                    return False
                ev = e.event
                if ev is None:
                    ev = e.event = asyncio.Event()
                self.wake.set()
                left = deadline - self.mono()
                if left <= 0:
                    return False
                try:
                    async with asyncio.timeout(left):
                        await ev.wait()
                except TimeoutError:
                    return False
                if e.ledger.reserve(need):
                    return True
                if e.exhausted:
                    return False
        finally:
            e.need -= need

    def warn(self, rb: RuleBook, e: Entry, before: int, after: int) -> float | None:
        """The warn_at fraction this change of spent tokens passed (once per key and period)."""
        lg = e.ledger
        hit = crossed(lg.limit + lg.grant, before, after, rb.rule.warn_at)
        if hit is None or (lg.warned is not None and hit <= lg.warned):
            return None
        lg.warned = hit
        metrics.BUDGET_WARNINGS.labels(rb.rule.name, f"{hit:g}").inc()
        log.warning(
            "budget %s: key %s passed %g%% of %d tokens (period %s)",
            rb.rule.name, e.key, hit * 100, lg.limit + lg.grant, lg.window.id,
        )  # fmt: skip
        return hit

    def spent(self, e: Entry) -> int:
        """Tokens spent or reserved of `e` as this replica knows them."""
        lg = e.ledger
        if self.store is None:
            return lg.used + lg.reserved
        return lg.remote_used + lg.remote_reserved + lg.unreported + lg.reserved

    # -- the sync loop ------------------------------------------------------------------------
    async def run(self) -> None:
        while not self.services.closed:
            try:
                async with asyncio.timeout(self.interval_s):
                    await self.wake.wait()
            except TimeoutError:
                pass
            self.wake.clear()
            if self.store is None:
                return
            if self.down:
                continue  # the fleet store reconnects; its mode change wakes this loop
            try:
                await self.sync_once()
            except StoreUnavailable as e:
                self.last_error = str(e)

    def _retire(self, e: Entry) -> None:
        self.active.pop(id(e), None)
        if self.store is None or not e.rkey:
            return
        lg = e.ledger
        if lg.holding or lg.unreported or e.pending is not None:
            if len(self.retiring) >= MAX_RETIRING:
                dropped = self.retiring.pop(0)
                log.error(
                    "budgets: %d retired ledgers waiting for the store; %s dropped (%d tokens "
                    "used not reported)", MAX_RETIRING, dropped.key, dropped.ledger.unreported,
                )  # fmt: skip
            self.retiring.append(e)

    def _message(self, e: Entry, now: float, retiring: bool) -> Msg | None:
        if e.pending is not None:
            return e.pending  # the same message again: the store applies it once
        lg = e.ledger
        heartbeat = lg.holding > 0 and now - e.last_sync > self.ttl_s / 3
        unused = lg.avail > 0 and now - e.last_use > IDLE_S  # an idle share goes back
        if not (e.dirty or e.need or retiring or heartbeat or unused):
            return None
        idle = retiring or (lg.reserved == 0 and not e.need and now - e.last_use > IDLE_S)
        # The use per sync interval lately (a decaying peak), from the use since the last sync.
        since = max(now - e.last_sync, 0.001) if e.last_sync else self.interval_s
        e.flow = max(int(lg.unreported * self.interval_s / since), e.flow // 2)
        target = self.target(e)
        e.low = target // 2 + 1
        back, want = share_plan(lg.avail, target, idle)
        if e.need:  # requests wait: enough for all of them, and the usual share besides
            want = max(want, e.need - lg.avail + target // 2)
        if not (lg.unreported or back or want or heartbeat or e.dirty):
            return None
        e.seq += 1
        lg.avail -= back
        m = Msg(
            e.rkey, e.seq, lg.limit, lg.unreported, back, want, lg.reserved,
            expire_at(lg.window.end, e.length),
        )  # fmt: skip
        lg.unreported = 0
        e.pending = m
        e.dirty = False
        return m

    async def sync_once(self) -> None:
        store = self.store
        assert store is not None
        now = self.mono()
        entries: list[Entry] = []
        msgs: list[Msg] = []
        retiring, self.retiring = self.retiring, []
        for e in retiring:
            m = self._message(e, now, True)
            if m is not None:
                entries.append(e)
                msgs.append(m)
        n_retiring = len(entries)
        for e in list(self.active.values()):
            m = self._message(e, now, False)
            if m is not None:
                entries.append(e)
                msgs.append(m)
        try:
            for i in range(0, len(msgs), BATCH):
                replies = await store.sync(msgs[i : i + BATCH])
                for j, r in enumerate(replies):
                    self._apply(entries[i + j], r)
        finally:
            # What is still pending (this round failed) stays for the next one.
            self.retiring += [
                e for e in entries[:n_retiring] if e.pending is not None or e.ledger.holding
            ]
        if self.last_error:
            self.last_error = ""
            log.warning("budgets: the store answers again; local tallies reported")
        for e in list(self.active.values()):
            lg = e.ledger
            if e.pending is None and not lg.unreported and not lg.holding and not e.need:
                del self.active[id(e)]

    def _apply(self, e: Entry, r: Reply) -> None:
        lg = e.ledger
        m = e.pending
        e.exhausted = m is not None and r.granted < m.want
        e.pending = None
        e.last_sync = self.mono()
        if r.lost and lg.holding > 0:
            log.warning(
                "budgets: the store had expired this replica's lease of %s (period %s): "
                "%d tokens of reservations in flight were counted as spent there",
                e.key, lg.window.id, lg.reserved,
            )  # fmt: skip
        if r.lost:
            lg.lost()
        lg.avail += r.granted
        lg.granted += r.granted
        lg.remote_used, lg.remote_reserved = r.used, r.reserved
        for replica, tokens, in_flight in r.expired:
            self.expired_total += tokens
            rule = next((rb.rule.name for rb in self.rules.values() if e in
                         rb.entries.values()), "?")  # fmt: skip
            metrics.BUDGET_EXPIRED.labels(rule).inc(tokens)
            log.warning(
                "budget %s: replica %s not heard from for %gs: the %d tokens it held of key %s "
                "(%d of them reservations in flight) counted as spent (period %s)",
                rule, replica, self.ttl_s, tokens, e.key, in_flight, lg.window.id,
            )  # fmt: skip
        if e.event is not None:  # the waiting requests look again
            e.event.set()
            e.event = None

    def _unreachable(self, reason: str) -> None:
        self.last_error = reason or "unreachable"
        log.warning("budgets: the store is unreachable (%s); deciding on local shares", reason)
        for e in self.active.values():  # nobody waits for an answer that will not come
            if e.event is not None:
                e.event.set()
                e.event = None

    async def flush(self) -> None:
        """At stop: report what is left and give the shares back (one try, bounded)."""
        if self.store is None or self.down:
            return
        for rb in self.rules.values():
            for e in rb.entries.values():
                if e.ledger.holding or e.ledger.unreported:
                    self._retire(e)
        try:
            await self.sync_once()
        except StoreUnavailable as e:
            log.warning("budgets: final report failed (%s); the store expires the shares", e)

    async def aclose(self) -> None:
        await self.flush()

    # -- operators ----------------------------------------------------------------------------
    def rule(self, name: str) -> RuleBook:
        rb = self.by_name.get(name)
        if rb is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            raise KeyError(f"no budget named {name!r} (known: {known})")
        return rb

    async def figures(
        self, name: str, key: str, action: str = "show", tokens: int = 0
    ) -> dict[str, Any]:
        """`show`, `grant` (tokens more for this period) or `reset` one key's budget."""
        rb = self.rule(name)
        rule = rb.rule
        now = self.wall()
        win = window(rule.period, now)
        e = rb.entries.get(key)
        if e is not None and e.ledger.window.id != win.id:
            e = None
        limit = e.ledger.limit if e is not None else rule.limit(key, None, {})
        if self.store is not None:
            rkey = redis_key(self.store.prefix, rule.ident, key, win.id)
            f = await self.store.admin(
                rkey, action, tokens, limit, expire_at(win.end, win.end - win.start)
            )
        else:
            if e is None and action != "show":
                e = self.entry(rb, key, limit, now)
            if e is not None:
                lg = e.ledger
                if action == "grant":
                    lg.add(tokens)
                elif action == "reset":
                    lg.reset()
                f = Figures(lg.limit + lg.grant, lg.used, lg.reserved, lg.avail, lg.grant, 0)
            else:
                f = Figures(limit // self.workers, 0, 0, limit // self.workers, 0, 0)
        if action != "show":
            audit.warning(
                "budget %s: rule=%s key=%s tokens=%d period=%s now limit=%d used=%d",
                action, name, key, tokens, win.id, f.limit, f.used,
            )  # fmt: skip
        return {
            "rule": name,
            "key": key,
            "limit": f.limit,
            "used": f.used,
            "reserved": f.reserved,
            "remaining": max(0, f.remaining),
            "resets_at": iso(win.end),
            "period": win.id,
            "granted": f.granted,
            "expired": f.expired,
            "store": "redis" if self.store is not None else "memory",
        }

    # -- what /admin/state and /readyz show ---------------------------------------------------
    def state(self) -> dict[str, Any]:
        rules = []
        for rb in self.rules.values():
            keys = []
            for e in islice(reversed(rb.entries.values()), STATE_KEYS):  # most recent first
                lg = e.ledger
                keys.append({
                    "key": e.key, "period": lg.window.id, "limit": lg.limit + lg.grant,
                    "used": lg.used if self.store is None else lg.remote_used + lg.unreported,
                    "reserved": lg.reserved,
                    "share": lg.avail, "resets_at": iso(lg.window.end),
                })  # fmt: skip
            rules.append({
                "name": rb.rule.name, "period": rb.rule.period.label, "tokens": rb.rule.tokens,
                "keys_tracked": len(rb.entries), "counts": dict(rb.counts), "recent_keys": keys,
            })  # fmt: skip
        return {
            "store": "redis" if self.store is not None else "memory",
            "store_up": self.store is not None and not self.down,
            "replica": self.fleet.replica_id,
            "last_error": self.last_error,
            "expired_tokens": self.expired_total,
            "rules": rules,
        }

    def readiness(self) -> dict[str, Any]:
        return {"store": "redis" if self.store is not None else "memory", "down": self.down}


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


BUDGETS: Final = ServiceKey[Book]("budgets")


def book_for(services: Services) -> Book:
    fleet_for(services)  # first: owners close newest first, and the book's last report needs it
    return services.get(BUDGETS, lambda: Book(services))
