"""(compiled) The compiled policy: frozen lookup structures built once at load, used on every
request.

Pure (no I/O; a backend's TLS contexts come built by the loader). Route matching is a linear
scan over pre-lowered matchers in policy order; the first match wins. Which member of which
backend serves a matched request is decided by the route filter (`gateway.filters.routing`) from
the route's `targets` and the members' live state, kept in the services (`gateway.registry.pool`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.core.balancer import SmoothWeightedRoundRobin
from gateway.core.request import RequestInfo, Wire, first_route
from gateway.policy.model import Backend, Canary, Policy, Retries, Route, Sticky, Timeouts

if TYPE_CHECKING:
    from gateway.tls.upstream import ClientTls


@dataclass(frozen=True, slots=True)
class Endpoint:
    backend: str
    protocol: str  # "http" | "grpc"
    host: str
    port: int
    weight: int
    priority: int = 0
    tls: ClientTls | None = None  # the backend's `tls` section, built (None: plaintext)
    address: str = field(init=False, compare=False)  # host:port, IPv6 in brackets (made once)
    # What upstream connections and channels are keyed by: the address, and the TLS settings
    # (so a changed `tls` section opens new connections while the old ones drain).
    upstream_key: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        host = f"[{self.host}]" if ":" in self.host else self.host
        address = f"{host}:{self.port}"
        object.__setattr__(self, "address", address)
        tls = self.tls
        object.__setattr__(self, "upstream_key", address if tls is None else f"{address}#{tls.key}")


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class RouteTimeouts:
    """A route's `timeouts` as the request path reads them: a compiled class's fields are
    loads, a policy model's are lookups by name."""

    connect_s: float
    first_byte_s: float
    idle_s: float
    total_s: float
    body_read_s: float


def route_timeouts(t: Timeouts) -> RouteTimeouts:
    return RouteTimeouts(t.connect_s, t.first_byte_s, t.idle_s, t.total_s, t.body_read_s)


@dataclass(slots=True)
class CompiledRoute:
    name: str
    protocol: Wire | None  # None = any listener
    path_prefix: str
    methods: frozenset[str]
    headers: tuple[tuple[str, str | None], ...]
    endpoints: tuple[Endpoint, ...]  # the static members of its backends
    timeouts: RouteTimeouts
    strip_prefix: str
    targets: tuple[tuple[str, int], ...] = ()  # (backend name, weight) of the split
    canary: Canary | None = None
    retries: Retries | None = None
    sticky: Sticky | None = None
    # `timeouts` with connect and first byte capped per try
    try_timeouts: RouteTimeouts | None = None
    static_weights: tuple[float, ...] = ()  # each static endpoint's share of the route
    model_re: re.Pattern[str] | None = None  # `match.model` globs, compiled into one
    by_model: bool = False
    prefix_bytes: int = 0  # `affinity.prefix.bytes` (0 = no prefix affinity)
    load_factor: float = 0.0
    # The route is decided after the body phase (it needs the body's model or prompt).
    needs_body: bool = False
    api: str | None = None  # its API family (`gateway.core.apis`); None = by path
    _rr: SmoothWeightedRoundRobin | None = field(default=None, repr=False)

    def pick(self) -> Endpoint | None:
        """A static endpoint by weight, without any live state: for tools and tests. Requests
        are routed by `gateway.filters.routing` over the members' live state."""
        rr = self._rr
        if rr is None:
            rr = self._rr = SmoothWeightedRoundRobin(self.static_weights)
        i = rr.pick()
        return None if i is None else self.endpoints[i]

    def upstream_path(self, path: str) -> str:
        if self.strip_prefix and path.startswith(self.strip_prefix):
            path = path[len(self.strip_prefix) :] or "/"
            if not path.startswith("/"):
                path = "/" + path
        return path


@dataclass(slots=True)
class CompiledPolicy:
    policy: Policy
    version: str  # sha256 of the canonical JSON form, first 12 hex digits
    routes: tuple[CompiledRoute, ...]
    backends: dict[str, Backend]
    unary_methods: frozenset[str]

    body_routing: bool = False  # some route needs the body's model or prompt

    def match(self, info: RequestInfo, model: str | None = None) -> CompiledRoute | None:
        """The first route that matches; a route with `match.model` only for a `model` one of
        its globs matches (a request without a model never takes it). The filters on the
        request path call `first_route` over `routes` themselves."""
        return first_route(self.routes, info, model)

    def match_head(self, info: RequestInfo) -> CompiledRoute | None:
        """The first route whose protocol, path, methods and headers match, `match.model` not
        looked at: if it needs the body (`needs_body`), the route is decided after it."""
        return first_route(self.routes, info, None, by_model=False)


def endpoint_of(b: Backend, address: str, weight: int, priority: int) -> Endpoint:
    host, port = split_host_port(address)
    tls = None
    if b.tls is not None:
        from gateway.tls.upstream import client_tls

        tls = client_tls(b.tls)  # built by the loader already: shared, not read again
    return Endpoint(b.name, b.protocol, host, port, weight, priority, tls)


def _compile_route(r: Route, p: Policy, backends: dict[str, Backend]) -> CompiledRoute:
    targets = [(r.backend, 1)] if r.backend else [(w.backend, w.weight) for w in r.backends]
    static = [
        endpoint_of(backends[name], e.address, e.weight, e.priority)
        for name, _ in targets
        for e in backends[name].endpoints
    ]
    shares = [
        w * e.weight / (sum((x.weight for x in backends[name].endpoints), 0) or 1)
        for name, w in targets
        for e in backends[name].endpoints
    ]
    timeouts = route_timeouts(r.timeouts or p.timeouts)
    prefix = r.affinity.prefix if r.affinity is not None else None
    try_timeouts = None
    if r.retries is not None and r.retries.per_try_timeout_s is not None:
        cap = r.retries.per_try_timeout_s
        t = timeouts
        try_timeouts = RouteTimeouts(
            min(t.connect_s, cap), min(t.first_byte_s, cap), t.idle_s, t.total_s, t.body_read_s
        )
    return CompiledRoute(
        name=r.name,
        protocol=None if r.match.protocol == "any" else Wire(r.match.protocol),
        path_prefix=r.match.path_prefix,
        methods=frozenset(m.upper() for m in r.match.methods),
        headers=tuple((h.name.lower(), h.value) for h in r.match.headers),
        endpoints=tuple(static),
        timeouts=timeouts,
        strip_prefix=r.strip_prefix,
        targets=tuple(targets),
        canary=r.canary,
        retries=r.retries,
        sticky=r.sticky,
        try_timeouts=try_timeouts,
        static_weights=tuple(shares),
        model_re=model_pattern(r.match.model),
        by_model=r.by_model,
        prefix_bytes=prefix.bytes if prefix is not None else 0,
        load_factor=prefix.load_factor if prefix is not None else 0.0,
        needs_body=bool(r.match.model) or r.by_model or prefix is not None,
        api=None if r.api == "auto" else r.api,
    )


def model_pattern(globs: list[str]) -> re.Pattern[str] | None:
    """The globs as one case-sensitive regular expression (None for no globs)."""
    if not globs:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs))


def policy_version(p: Policy) -> str:
    canon = json.dumps(p.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:12]


def compile_policy(p: Policy) -> CompiledPolicy:
    backends = {b.name: b for b in p.backends}
    unary = frozenset(m for b in p.backends for m in b.unary_methods)
    routes = tuple(_compile_route(r, p, backends) for r in p.routes)
    return CompiledPolicy(
        policy=p,
        version=policy_version(p),
        routes=routes,
        backends=backends,
        unary_methods=unary,
        body_routing=any(r.needs_body for r in routes),
    )
