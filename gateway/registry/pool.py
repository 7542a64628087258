"""The backends owner in the services (`services.get(BACKENDS, ...)`): every backend member's
live state, which outlives policy reloads, and one view of each backend per policy section.

State, each kept in the pool under its own key (see `gateway.registry.member`):
- per backend and address (`Core`): requests in flight, heartbeat load, counters;
- per backend: where its prompt prefixes are placed and its members' smoothed loads
  (`gateway.core.placement.PrefixBook`);
- per backend, address and parameters: the breaker (`breaker` section), the outlier record
  (`outlier`), the health verdict and its check loop (`health`, and the backend's protocol);
- per backend and `discovery` section: the registry poller or DNS lookups and what they found;
- per route and canary section + split weights: the canary guard; per route and budget
  parameters: the retry budget.

A `BackendView` (`gateway.registry.view`) is one backend section as a policy wrote it: its
members (static ones from its endpoints, plus those its registry finds) over that shared state,
and the traffic plan the pure balancer picks from; views of equal sections are one object.

What a reload keeps, then: a member whose address stays keeps its in-flight count and load; its
breaker, outlier record and health while their section's parameters stay (a changed section
starts that part fresh); a changed weight or priority applies at once; a member no longer named
loses nothing others need (requests still running on it finish; its checks stop). A route's
canary guard stays while its canary section and split weights stay (any change re-arms it). Both
policies of a staged rollout are served from their own views over the same state, so each sees
its own members. Background work (health checks, registry polls) runs for the views of the
policy activated last and of any policy that served a request in the last `IDLE_S` seconds.
State no view holds any more (a changed section's breaker, outlier record or health check, a
renamed backend's prefix placements, an older policy's canary guards and retry budgets) is
forgotten at the next sweep (every `SWEEP_S` seconds, and at each activation), so a stream of
reloads leaves the state of the policies in use, not of every policy since start.
"""

from __future__ import annotations

import asyncio
import logging
import random as _random
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

from gateway.core.breaker import Breaker, BreakerParams
from gateway.core.canary import CanaryGuard, CanaryParams
from gateway.core.health import HealthParams, HealthState
from gateway.core.outlier import Outlier, OutlierParams
from gateway.core.placement import PrefixBook
from gateway.core.retry import RetryBudget
from gateway.registry.dns import DnsWatcher
from gateway.registry.heartbeats import Watcher
from gateway.registry.member import BreakerBox, Core, HealthBox
from gateway.registry.models import MODELS
from gateway.registry.scrape import Scraper
from gateway.registry.view import BackendView
from gateway.services import ServiceKey
from gateway.tls.upstream import client_tls

if TYPE_CHECKING:
    from gateway.policy.compiled import Endpoint
    from gateway.policy.model import Backend, Canary
    from gateway.services import Services

log = logging.getLogger("sluice.backends")

IDLE_S = 30.0  # a view no request picked from for this long (and not the latest) stops its work
SWEEP_S = 5.0
LIVE_POOLS: weakref.WeakSet[BackendPool] = weakref.WeakSet()  # read by the metrics collector


def _forget(book: dict[Any, Any], keep: set[int]) -> None:
    for k in [k for k, x in book.items() if id(x) not in keep]:
        del book[k]


class ViewHold:
    """What one view holds of the pool's state, tracked weakly by the pool (the sweep keeps what
    any live view holds). Only its view refers to it, so it lives exactly as long as the view; a
    view (compiled) cannot be referred to weakly itself. The members dict is the view's own, so
    members a registry or DNS adds later are seen too."""

    __slots__ = (
        "view_id", "members", "prefixes", "watcher", "scraper", "models", "protocol", "__weakref__",
    )  # fmt: skip

    def __init__(self, v: BackendView) -> None:
        self.view_id = id(v)
        self.members = v.members
        self.prefixes = v.prefixes
        self.watcher = v.watcher
        self.scraper = v.scraper
        self.models = v.models
        self.protocol = v.cfg.protocol


class BackendPool:
    """The services' owner of every backend member's state (key "backends")."""

    def __init__(self, services: Services, random: Callable[[], float] | None = None) -> None:
        self.services = services
        self.clock = services.clock
        self.random: Callable[[], float] = random or _random.Random().random
        self.cores: dict[tuple[str, str], Core] = {}
        self.boxes: dict[tuple[str, str, BreakerParams], BreakerBox] = {}
        self.outliers: dict[tuple[str, str, OutlierParams], Outlier] = {}
        self.healths: dict[tuple[Any, ...], HealthBox] = {}
        self.books: dict[str, PrefixBook] = {}
        self.watchers: dict[tuple[str, str], Watcher | DnsWatcher] = {}
        self.scrapers: dict[tuple[str, str], Scraper] = {}
        self.guards: dict[tuple[str, str], CanaryGuard] = {}
        self.budgets: dict[tuple[str, float, int], RetryBudget] = {}
        self.views: dict[tuple[str, str], BackendView] = {}  # reusable by the next build
        # What the views any policy may use hold (each view's `ViewHold`, made with it).
        self._alive: weakref.WeakSet[ViewHold] = weakref.WeakSet()
        self.latest: dict[str, BackendView] = {}  # the views of the policy activated last
        self.pickers: dict[str, Any] = {}  # its route pickers (state, metrics)
        self.epoch = 0
        self.started = False
        self._sweeper: asyncio.Task[None] | None = None
        LIVE_POOLS.add(self)

    def changed(self) -> None:
        """Some member state changed: every view rebuilds its plan at its next pick."""
        self.epoch += 1

    # --- shared state, created on first use -----------------------------------------------------
    def core(self, backend: str, address: str) -> Core:
        c = self.cores.get((backend, address))
        if c is None:
            c = self.cores[(backend, address)] = Core(backend, address)
        return c

    def box(self, backend: str, address: str, p: BreakerParams) -> BreakerBox:
        b = self.boxes.get((backend, address, p))
        if b is None:
            b = self.boxes[(backend, address, p)] = BreakerBox(Breaker(p, self.random))
        return b

    def outlier(self, backend: str, address: str, p: OutlierParams) -> Outlier:
        o = self.outliers.get((backend, address, p))
        if o is None:
            o = self.outliers[(backend, address, p)] = Outlier(p)
        return o

    def health(self, backend: str, ep: Endpoint, p: HealthParams, check: Any) -> HealthBox:
        key = (backend, ep.upstream_key, ep.protocol, p, check.path, check.grpc_service)
        h = self.healths.get(key)
        if h is None:
            h = self.healths[key] = HealthBox(HealthState(p), ep, check)
        return h

    def prefixes(self, backend: str) -> PrefixBook:
        b = self.books.get(backend)
        if b is None:
            b = self.books[backend] = PrefixBook()
        return b

    def watcher(self, backend: str, reg: Any) -> Watcher:
        key = (backend, reg.model_dump_json())
        w = self.watchers.get(key)
        if not isinstance(w, Watcher):
            w = Watcher(self.services, self, backend, reg)
            self.watchers[key] = w
        return w

    def dns_watcher(self, backend: str, cfg: Any) -> DnsWatcher:
        key = (backend, "dns:" + cfg.model_dump_json())
        w = self.watchers.get(key)
        if not isinstance(w, DnsWatcher):
            w = DnsWatcher(self.services, self, backend, cfg)
            self.watchers[key] = w
        return w

    def scraper(self, cfg: Backend) -> Scraper | None:
        """The scrapes of the backend's `load.metrics` section (None without one)."""
        if cfg.load is None or cfg.load.metrics is None:
            return None
        key = (cfg.name, f"{cfg.load.metrics.model_dump_json()}|{cfg.max_in_flight}")
        s = self.scrapers.get(key)
        if s is None:
            s = self.scrapers[key] = Scraper(self.services, self, cfg.name, cfg.load.metrics,
                                             cfg.max_in_flight)  # fmt: skip
        return s

    def view(self, cfg: Backend) -> BackendView:
        # The TLS fingerprint too: a reload that reads changed certificate files gets new views
        # (members on new connections) even if the section's text is the same.
        tls = client_tls(cfg.tls).key if cfg.tls is not None else ""
        key = (cfg.name, cfg.model_dump_json() + tls)
        v = self.views.get(key)
        if v is None:
            v = self.views[key] = BackendView(self, cfg, key)
            v.hold = hold = ViewHold(v)
            self._alive.add(hold)
        return v

    def guard(
        self, route: str, canary: Canary | None, targets: tuple[tuple[str, int], ...]
    ) -> CanaryGuard | None:
        if canary is None:
            return None
        key = (route, f"{canary.model_dump_json()}|{targets}")
        g = self.guards.get(key)
        if g is None:
            p = CanaryParams(canary.p95_ms, canary.max_error_ratio, canary.window_s,
                             canary.min_requests)  # fmt: skip
            g = self.guards[key] = CanaryGuard(p)
        return g

    def budget(self, route: str, ratio: float, floor: int) -> RetryBudget:
        b = self.budgets.get((route, ratio, floor))
        if b is None:
            b = self.budgets[(route, ratio, floor)] = RetryBudget(ratio, floor)
        return b

    # --- lifecycle --------------------------------------------------------------------------------
    def activate(self, views: Iterable[BackendView], pickers: dict[str, Any]) -> None:
        """A policy goes live: its views become the latest; background work follows them."""
        latest = {}
        for v in views:
            latest[v.name] = v
            self.views[v.key] = v
        self.latest = latest
        self.pickers = pickers
        self.changed()
        self.sweep(self.clock.now())
        self.start()  # without a running loop, the first request starts it

    def start(self) -> None:
        """Start background work (needs a running loop): at activation, or the first request.
        Without a running loop (a tool, a synchronous test) it does nothing."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self.started = True
        for v in self.latest.values():
            v.start_work()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = self.services.spawn(self._sweep_loop(), "backends:sweep")

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep(self.clock.now())

    def sweep(self, now: float) -> None:
        """Stop the work of views no policy serves from any more; forget state no view holds."""
        working = {id(v) for v in self.latest.values()}
        for key, v in list(self.views.items()):
            if id(v) not in working and now - v.last_pick >= IDLE_S:
                del self.views[key]  # the next build makes a new view if it needs one
        working |= {id(v) for v in self.views.values() if now - v.last_pick < IDLE_S}
        alive = list(self._alive)
        held: set[int] = set()
        checked: set[int] = set()
        for hold in alive:
            works = hold.view_id in working
            held.add(id(hold.prefixes))
            for m in hold.members.values():
                held.update((id(m.core), id(m.box), id(m.outlier), id(m.hbox)))
                if works and m.hbox is not None:
                    checked.add(id(m.hbox))
            if hold.watcher is not None:
                held.add(id(hold.watcher))
                if works:
                    checked.add(id(hold.watcher))
            if hold.scraper is not None:
                held.add(id(hold.scraper))
                if works:
                    checked.add(id(hold.scraper))
            if hold.models is not None:
                boxes = {id(b) for b in hold.models.boxes.values()}
                held |= boxes
                if works:
                    checked |= boxes
        _forget(self.cores, held)
        _forget(self.boxes, held)
        _forget(self.outliers, held)
        _forget(self.books, held)  # a renamed backend's placements
        for hk, h in list(self.healths.items()):
            if id(h) not in checked:
                h.stop()
            if id(h) not in held:
                del self.healths[hk]
        for wk, w in list(self.watchers.items()):
            if id(w) not in checked:
                w.stop()
            if id(w) not in held:
                del self.watchers[wk]
        for sk, s in list(self.scrapers.items()):
            if id(s) not in checked:
                s.stop()
            if id(s) not in held:
                del self.scrapers[sk]
        book = self.services.peek(MODELS)
        if book is not None:
            book.forget(held, checked)
        # Guards and budgets of older policies: their pickers still hold them; only a later
        # build of the same section would find them here (a guard re-armed by then is right:
        # its section changed in between).
        _forget(self.guards, {id(p.guard) for p in self.pickers.values()})
        _forget(self.budgets, {id(p.budget) for p in self.pickers.values()})

    def upstream_keys(self, protocol: str) -> set[str]:
        """`Endpoint.upstream_key` (address and TLS settings) of the members a registry or DNS found
        for the live backends speaking `protocol` (static members are in the policy; an old
        policy's view may linger until swept)."""
        return {
            m.endpoint.upstream_key
            for v in self._alive
            if v.protocol == protocol
            for m in v.members.values()
            if m.source != "static"
        }  # fmt: skip

    def readiness(self) -> dict[str, object]:
        now = self.clock.now()
        out: dict[str, object] = {}
        for name, v in self.latest.items():
            plan = v.plan(now)
            item: dict[str, object] = {"available": plan.available, "members": plan.members}
            if v.watcher is not None:
                item["registry_up"] = v.watcher.up
            out[name] = item
        return out

    def state(self) -> dict[str, object]:
        now = self.clock.now()
        return {
            "backends": {name: v.state(now) for name, v in self.latest.items()},
            "routes": {name: p.state(now) for name, p in self.pickers.items()},
        }

    def aclose(self) -> None:
        for h in self.healths.values():
            h.stop()
        for w in self.watchers.values():
            w.stop()
        for s in self.scrapers.values():
            s.stop()
        LIVE_POOLS.discard(self)


BACKENDS: Final = ServiceKey[BackendPool]("backends")  # every backend member's state
