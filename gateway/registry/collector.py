"""Backend state as Prometheus gauges, read at scrape time (nothing on the request path).

Per member (`backend`, `member` = host:port; members are bounded by the policy and the registry's
`max_members`): available, healthy, breaker state (0 closed, 1 half-open, 2 open), ejected,
weight, heartbeat load, requests in flight, the model server's own figures (`load.metrics`).
Per backend: panic, registry (or DNS) up, members. Per route: the effective split weight per
backend (a guarded canary shows 0), canary guard tripped, retry budget (limit, in flight,
active requests). Under `--workers N` these are the answering
worker's view.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gateway.core.breaker import State
from gateway.core.serverload import fresh
from gateway.registry.member import Core
from gateway.registry.pool import LIVE_POOLS

_BREAKER = {State.CLOSED: 0.0, State.HALF_OPEN: 1.0, State.OPEN: 2.0}


class BackendsCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        ml = ["backend", "member"]
        available = GaugeMetricFamily(
            "sluice_backend_member_available", "1 if the member takes traffic now.", labels=ml
        )
        healthy = GaugeMetricFamily(
            "sluice_backend_member_healthy", "Active health check verdict (1 healthy).", labels=ml
        )
        breaker = GaugeMetricFamily(
            "sluice_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.", labels=ml
        )
        ejected = GaugeMetricFamily(
            "sluice_outlier_ejected", "1 while the member is ejected as an outlier.", labels=ml
        )
        weight = GaugeMetricFamily("sluice_backend_member_weight", "Member weight.", labels=ml)
        load = GaugeMetricFamily(
            "sluice_backend_member_load", "Heartbeat load of the member (0-100).", labels=ml
        )
        inflight = GaugeMetricFamily(
            "sluice_backend_member_in_flight", "Requests in flight to the member.", labels=ml
        )
        server = GaugeMetricFamily(
            "sluice_backend_member_server",
            "The member's model-server figures (load.metrics) while fresh: running, waiting, "
            "kv_cache (0-1), full (1/0), adds (requests in flight they add in the pick).",
            labels=[*ml, "figure"],
        )  # fmt: skip
        panic = GaugeMetricFamily(
            "sluice_backend_panic", "1 while the backend is in panic mode.", labels=["backend"]
        )
        reg_up = GaugeMetricFamily(
            "sluice_registry_up", "1 if the heartbeat registry (or DNS) answered its last read.",
            labels=["backend"],
        )  # fmt: skip
        route_w = GaugeMetricFamily(
            "sluice_route_backend_weight", "Effective split weight of a backend in a route.",
            labels=["route", "backend"],
        )  # fmt: skip
        guarded = GaugeMetricFamily(
            "sluice_canary_guarded", "1 once the canary guard set the canary's weight to 0.",
            labels=["route", "backend"],
        )  # fmt: skip
        budget = GaugeMetricFamily(
            "sluice_retry_budget", "Retry budget: limit, in_flight (retries), active (requests).",
            labels=["route", "kind"],
        )  # fmt: skip
        for pool in list(LIVE_POOLS):
            now = pool.clock.now()
            for name, v in pool.latest.items():
                plan = v.plan(now)
                taking = {id(m) for lv in plan.levels for m in lv.members}
                for m in v.members.values():
                    lv = [name, m.address]
                    available.add_metric(lv, 1.0 if id(m) in taking else 0.0)
                    if m.hbox is not None:
                        healthy.add_metric(lv, 1.0 if m.hbox.state.healthy else 0.0)
                    if m.breaker is not None:
                        breaker.add_metric(lv, _BREAKER[m.breaker.state])
                    if m.outlier is not None:
                        ejected.add_metric(lv, 1.0 if m.outlier.ejected(now) else 0.0)
                    weight.add_metric(lv, m.weight)
                    load.add_metric(lv, m.core.load)
                    inflight.add_metric(lv, float(m.core.in_flight))
                    _server(server, lv, m.core, now)
                panic.add_metric([name], 1.0 if v.panic else 0.0)
                if v.watcher is not None and v.watcher.up is not None:
                    reg_up.add_metric([name], 1.0 if v.watcher.up else 0.0)
            for rname, p in pool.pickers.items():
                for bname, w in p.effective_weights(now).items():
                    route_w.add_metric([rname, bname], w)
                if p.guard is not None:
                    canary = p.groups[p.canary].name
                    guarded.add_metric([rname, canary], 1.0 if p.guard.tripped else 0.0)
                if p.budget is not None:
                    b = p.budget
                    budget.add_metric([rname, "limit"], float(b.limit()))
                    budget.add_metric([rname, "in_flight"], float(b.retrying))
                    budget.add_metric([rname, "active"], float(b.active))
        return [
            available, healthy, breaker, ejected, weight, load, inflight, server, panic, reg_up,
            route_w, guarded, budget,
        ]  # fmt: skip


def _server(family: GaugeMetricFamily, lv: list[str], core: Core, now: float) -> None:
    rec, f = core.scrape, core.figures
    if rec is None or f is None or not fresh(f, now, rec.interval):
        return
    for name, v in (("running", f.running), ("waiting", f.waiting), ("kv_cache", f.kv_cache)):
        if v is not None:
            family.add_metric([*lv, name], v)
    family.add_metric([*lv, "full"], 1.0 if rec.full else 0.0)
    family.add_metric([*lv, "adds"], core.server)


COLLECTOR = BackendsCollector()


def register(registry: CollectorRegistry, collector: Collector = COLLECTOR) -> None:
    """Add `collector` (by default this one) to `registry` once (the admin app may be built
    more than once)."""
    try:
        registry.register(collector)
    except ValueError:
        pass  # already there
