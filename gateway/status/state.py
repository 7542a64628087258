"""Assembles the `/admin/state` document (shapes in `gateway.status`) from the running server.

What exists in the gateway itself (policy, routes, backends of the compiled policy with each
member's upstream connections or gRPC channel state, in-flight, datapath, rejection and
upstream-error counters) is the base; the feature owners' `Services.state()` is merged over it;
then the colours are decided (`gateway.core.status`). A `StatusBoard` also samples the colour
every `SAMPLE_S` seconds for the history and keeps counter snapshots for the "recent" window.
Reading the state never creates a pool, a channel or a connection.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry

from gateway.core.status import (
    backend_colour,
    deltas,
    ejected,
    healthy,
    member_colour,
    rank,
    rollup,
)
from gateway.settings import Settings
from gateway.status.series import Series, counts
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from gateway.app import Gateway
    from gateway.datapath import Datapath

SAMPLE_S = 5.0  # colour history and charts resolution (the default of SLUICE_STATUS_SAMPLE_S)
KEEP_S = 900.0  # colour history length
RECENT_S = 300.0  # "recent" rejections and upstream errors: the last 5 minutes

try:
    VERSION = version("sluice")
except PackageNotFoundError:  # a checkout that was never installed
    VERSION = "unknown"


def merge(base: Any, extra: Any) -> Any:
    """`extra` over `base`: dicts key by key, lists of dicts item by item (matched on `name`,
    else `address`; a dict of dicts `{name: {...}}` counts as such a list), anything else
    replaced by `extra`."""
    if isinstance(base, Mapping) and isinstance(extra, Mapping):
        out = dict(base)
        for k, v in extra.items():
            out[k] = merge(out[k], v) if k in out else v
        return out
    if isinstance(base, list) and _by_name(extra):
        extra = [{"name": k, **v} for k, v in extra.items()]  # {name: {...}} is a list too
    if isinstance(base, list) and isinstance(extra, list):
        key = _identity(base + extra)
        if key is None:
            return extra
        out_list = list(base)
        index = {item.get(key): i for i, item in enumerate(out_list)}
        for item in extra:
            i = index.get(item.get(key))
            if i is None:
                out_list.append(item)
            else:
                out_list[i] = merge(out_list[i], item)
        return out_list
    return extra


def _by_name(v: Any) -> bool:
    return isinstance(v, Mapping) and bool(v) and all(isinstance(x, Mapping) for x in v.values())


def _identity(items: list[Any]) -> str | None:
    if not items or not all(isinstance(x, Mapping) for x in items):
        return None
    for key in ("name", "address"):
        if all(key in x for x in items):
            return key
    return None


class Served(Protocol):
    """What the state document reads from the running server (`gateway.server.Server`)."""

    @property
    def gateway(self) -> Gateway: ...

    @property
    def ports(self) -> Mapping[str, int]:
        """Bound port by listener name (admin, http, grpc)."""

    @property
    def datapath(self) -> Datapath | None: ...


class StatusBoard:
    """The state document's builder and its memory (colour history, counter snapshots)."""

    def __init__(self, server: Served, registry: CollectorRegistry) -> None:
        self.server = server
        self.registry = registry
        self.started_at = time.time()
        self.sample_s = sample_s = Settings.from_env().status_sample_s
        self.colours: deque[tuple[float, str]] = deque(maxlen=int(KEEP_S / sample_s))
        self.snapshots: deque[tuple[float, dict[str, float]]] = deque(
            maxlen=int(RECENT_S / sample_s) + 1
        )
        self.series = Series(sample_s)

    async def run(self) -> None:
        """Sample the colour, the counters and the charts' series every `sample_s` seconds
        (SAMPLE_S unless SLUICE_STATUS_SAMPLE_S says otherwise; a services task)."""
        while True:
            self.sample()
            await asyncio.sleep(self.sample_s)

    def sample(self) -> None:
        now = time.time()
        doc = self.state(now)
        self.colours.append((now, doc["colour"]))
        self.snapshots.append((now, self._counters()))
        routes: dict[str, set[str]] = {}
        for r in self.server.gateway.active.policy.routes:
            routes[r.name] = {e.backend for e in r.endpoints}
        alone = {name: next(iter(bs)) for name, bs in routes.items() if len(bs) == 1}
        self.series.sample(now, counts(self._charted(), alone), doc)

    # -- the document ----------------------------------------------------------------------
    def state(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        server, gw = self.server, self.server.gateway
        counters = self._counters()
        base_t, base = self.snapshots[0] if self.snapshots else (self.started_at, {})
        recent = deltas(counters, base)
        doc: dict[str, Any] = {
            "now": now,
            "gateway": self._gateway(now),
            "policy": gw.holder.status(),
            "routes": [
                {
                    "name": r.name,
                    "protocol": r.protocol.value if r.protocol else "any",
                    "path_prefix": r.path_prefix,
                    "backends": sorted({e.backend for e in r.endpoints}),
                }
                for r in gw.active.policy.routes
            ],
            "backends": {"backends": self._backends(counters, recent)},
            "rejections": {
                "window_s": round(now - base_t, 1),
                "recent": _strip(recent, "rejected:"),
                "total": _strip(counters, "rejected:"),
            },
        }
        if server.datapath is not None:
            doc["datapath"] = server.datapath.status()
        doc = merge(doc, gw.services.state())
        _colour_backends(doc)
        doc["colour"], doc["reasons"] = rollup(doc)
        doc["history"] = [{"t": t, "colour": c} for t, c in self.colours]
        doc["series"] = self.series.state()
        return doc

    def _gateway(self, now: float) -> dict[str, Any]:
        server, gw = self.server, self.server.gateway
        state = "draining" if gw.draining else ("ready" if gw.ready else "starting")
        listeners = gw.active.policy.policy.listeners
        out = []
        for name, port in server.ports.items():
            cfg = getattr(listeners, name, None)
            out.append({"name": name, "host": getattr(cfg, "host", ""), "port": port})
        return {
            "state": state,
            "pid": os.getpid(),
            "version": VERSION,
            "uptime_s": round(now - self.started_at, 1),
            "in_flight": gw.inflight.count,
            "listeners": out,
        }

    def _backends(
        self, counters: Mapping[str, float], recent: Mapping[str, float]
    ) -> list[dict[str, Any]]:
        gw = self.server.gateway
        upstreams = gw.upstream_state()
        rows = []
        for b in gw.active.policy.backends.values():
            live = upstreams["http" if b.protocol == "http" else "grpc"]
            members = []
            for e in b.endpoints:
                m: dict[str, Any] = {"address": e.address, "weight": e.weight}
                got = live.get(e.address)
                if got:
                    m.update(got)
                    if "connections" in got:
                        m["in_flight"] = got["connections"] - got.get("idle", 0)
                members.append(m)
            prefix = f"upstream:{b.name}:"
            rows.append(
                {
                    "name": b.name,
                    "protocol": b.protocol,
                    "recent_errors": sum(v for k, v in recent.items() if k.startswith(prefix)),
                    "errors": _strip(counters, prefix),
                    "members": members,
                }
            )
        return rows

    def _counters(self) -> dict[str, float]:
        """Rejections by reason and upstream errors by backend and kind, over all workers."""
        out: dict[str, float] = {}
        for family in self._families():
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                if family.name == "sluice_rejected":
                    key = f"rejected:{s.labels.get('reason', '')}"
                elif family.name == "sluice_upstream_errors":
                    key = f"upstream:{s.labels.get('backend', '')}:{s.labels.get('kind', '')}"
                else:
                    continue
                out[key] = out.get(key, 0.0) + s.value
        return out

    def _charted(self) -> Iterable[Metric]:
        metrics.flush()
        if self.registry is metrics.REGISTRY:
            return [*metrics.REQUESTS.collect(), *metrics.REQUEST_SECONDS.collect(),
                    *metrics.TIME_TO_FIRST_TOKEN.collect()]  # fmt: skip
        return self.registry.collect()

    def _families(self) -> Iterable[Metric]:
        if self.registry is metrics.REGISTRY:  # one process: read the two counters only
            return [*metrics.REJECTED.collect(), *metrics.UPSTREAM_ERRORS.collect()]
        return self.registry.collect()  # --workers N: every worker's files


def _strip(d: Mapping[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix) :]: v for k, v in d.items() if k.startswith(prefix)}


def _colour_backends(doc: dict[str, Any]) -> None:
    """Each member's and backend's colour, worst first (a feature's own colour is kept when
    it is worse)."""
    section = doc.get("backends")
    rows = section.get("backends") if isinstance(section, dict) else None
    if not isinstance(rows, list):
        return
    rows[:] = [b for b in rows if isinstance(b, dict)]
    for b in rows:
        members = b.get("members")
        if isinstance(members, list):
            members[:] = [m for m in members if isinstance(m, dict)]
            for m in members:
                # Flat fields the page shows first, read from a feature's snapshots when it
                # gives only those (its own fields are left as they are).
                if "healthy" not in m and healthy(m) is not None:
                    m["healthy"] = healthy(m)
                if "ejected" not in m and "outlier" in m:
                    m["ejected"] = ejected(m)
                m["colour"] = member_colour(m)
            members.sort(key=lambda m: -rank(m["colour"]))
        b["colour"] = backend_colour(b)[0]
    rows.sort(key=lambda b: -rank(b["colour"]))
