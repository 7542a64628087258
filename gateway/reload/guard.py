"""The change guard: replays the recent traffic through the running and the new policy and says
how much of it the new one would refuse. Pure: policies and a traffic snapshot in, a report out.

For each recorded request shape (see `traffic.py`) both policies decide from what can be known
without sending anything:

- `no_route`: no route of the new policy matches the shape;
- `no_endpoint`: the matching route has no usable endpoint (every weight on the way is 0);
- `body_too_large` (HTTP): bodies certainly above the new `limits.max_body_bytes` and within
  the old one;
- `first_byte_timeout` (HTTP): first response bytes certainly later than the new route's
  `timeouts.first_byte_s` and sooner than the old one's;
- `total_timeout`: whole requests certainly longer than the new `total_s`, shorter than the old.

Latencies are known only for requests a backend answered; the share of a request shape's
answered requests that a timeout would cut is applied to all requests of that shape (whatever
route served them: requests refused under an earlier policy still have a latency through the
ones that were answered).

A request counts only when the old policy served it and the new one would not ("newly
refused"). Histogram buckets are read conservatively (only buckets entirely past a limit count),
and a shape's requests are counted once, under its largest kind, so the share is a lower bound.
The change is *held* when that share reaches `guard.max_affected_share` of the window's requests
(with at least `guard.min_requests` of them; less traffic than that and nothing is judged).
What the guard does not see: auth and rate-limit decisions (they need the requests themselves),
backend health, and headers the running policy's routes do not match on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gateway.core.histogram import latency_between, merge, quantile, size_between
from gateway.policy.compiled import CompiledPolicy, CompiledRoute
from gateway.policy.model import Guard, Policy
from gateway.reload.traffic import Shape, TrafficSnapshot

REFUSAL_KINDS = ("no_route", "no_endpoint")


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    route: str  # the route that served these requests ("" = none)
    new_route: str  # the new policy's route for them ("" = none)
    requests: int
    share: float  # of all requests in the window
    detail: str

    def line(self) -> str:
        where = f"route {self.route or '(none)'}"
        if self.new_route and self.new_route != self.route:
            where += f" -> {self.new_route}"
        return f"{self.kind}: {100 * self.share:.1f}% ({self.requests} requests, {where}): " + (
            self.detail
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "route": self.route,
            "new_route": self.new_route,
            "requests": self.requests,
            "share": round(self.share, 4),
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class GuardReport:
    total: int  # requests in the window
    window_s: float
    affected: int  # requests the new policy would refuse (lower bound)
    threshold: float
    held: bool
    findings: tuple[Finding, ...] = ()
    warnings: tuple[str, ...] = ()  # what is wrong in the new policy whatever the traffic
    note: str = ""

    @property
    def share(self) -> float:
        return self.affected / self.total if self.total else 0.0

    def lines(self) -> list[str]:
        head = (
            f"guard: HELD: {100 * self.share:.1f}% of recent traffic would be refused"
            if self.held
            else f"guard: ok: {100 * self.share:.1f}% of recent traffic would be refused"
        )
        head += (
            f" ({self.affected} of {self.total} requests in the last {self.window_s:.0f}s; "
            f"threshold {100 * self.threshold:.0f}%)"
        )
        if self.note:
            head = f"guard: {self.note}"
        out = [head]
        out += [f"  {f.line()}" for f in self.findings]
        out += [f"  warning: {w}" for w in self.warnings]
        if self.held:
            out.append("  apply anyway with --force (POST /admin/policy/reload?force=1)")
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "held": self.held,
            "share": round(self.share, 4),
            "affected": self.affected,
            "requests": self.total,
            "window_s": self.window_s,
            "threshold": self.threshold,
            "findings": [f.as_json() for f in self.findings],
            "warnings": list(self.warnings),
            "note": self.note,
        }


def usable_routes(policy: Policy) -> frozenset[str]:
    """Names of the routes with at least one endpoint of non-zero weight on a non-zero target."""
    endpoints_ok = {b.name: any(e.weight > 0 for e in b.endpoints) for b in policy.backends}
    out = set()
    for r in policy.routes:
        targets = [(r.backend, 1)] if r.backend else [(w.backend, w.weight) for w in r.backends]
        if any(w > 0 and endpoints_ok.get(name, False) for name, w in targets):
            out.add(r.name)
    return frozenset(out)


def static_warnings(policy: Policy) -> list[str]:
    """Problems of a policy that refuse requests whatever the traffic."""
    if not policy.routes:
        return ["the policy has no routes: every request gets 404 / UNIMPLEMENTED"]
    usable = usable_routes(policy)
    return [
        f"route {r.name!r} has no usable endpoint (every weight is 0): its requests get 503"
        for r in policy.routes
        if r.name not in usable
    ]


class _Decider:
    def __init__(self, c: CompiledPolicy) -> None:
        self.c = c
        self.usable = usable_routes(c.policy)
        self.max_body = c.policy.limits.max_body_bytes

    def decide(self, shape: Shape) -> tuple[str, CompiledRoute | None]:
        route = self.c.match(shape.info())
        if route is None:
            return "no_route", None
        if route.name not in self.usable:
            return "no_endpoint", route
        return "ok", route


Latency = tuple[list[int], list[int]]  # (first byte, duration) histograms of a request shape


def _latencies(traffic: TrafficSnapshot) -> dict[Any, Latency]:
    out: dict[Any, Latency] = {}
    for shape in traffic.shapes:
        st = shape.stats
        lat = out.get(shape.request_key)
        if lat is None:
            out[shape.request_key] = (list(st.first_byte), list(st.duration))
        else:
            merge(lat[0], st.first_byte)
            merge(lat[1], st.duration)
    return out


def _scaled(count: int, hist: list[int], at_least: float, below: float) -> int:
    """Of `count` requests, how many the answered ones in `hist` say a timeout would cut."""
    answered = sum(hist)
    if not answered:
        return 0
    return round(count * latency_between(hist, at_least, below) / answered)


def _limit_counts(
    shape: Shape,
    old: _Decider,
    new: _Decider,
    o: CompiledRoute,
    n: CompiledRoute,
    latency: Latency,
) -> dict[str, tuple[int, str]]:
    st = shape.stats
    first_byte, duration = latency
    out: dict[str, tuple[int, str]] = {}
    if shape.protocol == "http":
        if new.max_body < old.max_body:
            k = size_between(st.body, new.max_body, old.max_body)
            if k:
                out["body_too_large"] = (
                    k,
                    f"limits.max_body_bytes {old.max_body} -> {new.max_body}",
                )
        nf, of = n.timeouts.first_byte_s, o.timeouts.first_byte_s
        if nf < of:
            k = _scaled(st.count, first_byte, nf, of)
            if k:
                p50 = quantile(first_byte, 0.5) or 0.0
                out["first_byte_timeout"] = (
                    k,
                    f"timeouts.first_byte_s {of:g} -> {nf:g}; observed first byte p50 {p50:.3f}s",
                )
    nt, ot = n.timeouts.total_s, o.timeouts.total_s
    if nt < ot:
        k = _scaled(st.count, duration, nt, ot)
        if k:
            p50 = quantile(duration, 0.5) or 0.0
            out["total_timeout"] = (
                k,
                f"timeouts.total_s {ot:g} -> {nt:g}; observed duration p50 {p50:.3f}s",
            )
    return out


def _refusal_detail(kind: str, shape: Shape, route: CompiledRoute | None) -> str:
    if kind == "no_route":
        return f"no route of the new policy matches (e.g. {shape.method} {shape.path})"
    assert route is not None
    return f"route {route.name!r} has no usable endpoint (every weight is 0)"


def check_change(
    old: CompiledPolicy, new: CompiledPolicy, traffic: TrafficSnapshot, guard: Guard
) -> GuardReport:
    """What `new` would refuse of the traffic `old` served; `held` when it is too much."""
    total = traffic.total
    warnings = tuple(static_warnings(new.policy))
    od, nd = _Decider(old), _Decider(new)
    groups: dict[tuple[str, str, str], list[Any]] = {}  # (kind, route, new route) -> [n, detail]
    affected = 0
    approximate = 0
    latencies = _latencies(traffic)
    for shape in traffic.shapes:
        count = shape.stats.count
        o_kind, o_route = od.decide(shape)
        n_kind, n_route = nd.decide(shape)
        if o_kind != "ok":
            continue  # refused already: not the change's doing
        if shape.stats.approximate:
            approximate += count
        assert o_route is not None
        if n_kind != "ok":
            kinds = {n_kind: (count, _refusal_detail(n_kind, shape, n_route))}
        else:
            assert n_route is not None
            kinds = _limit_counts(shape, od, nd, o_route, n_route, latencies[shape.request_key])
        if not kinds:
            continue
        affected += max(k for k, _ in kinds.values())
        new_name = n_route.name if n_route is not None else ""
        for kind, (k, detail) in kinds.items():
            g = groups.setdefault((kind, shape.route or o_route.name, new_name), [0, detail])
            g[0] += k
    findings = tuple(
        sorted(
            (
                Finding(kind, route, new_route, n, n / total if total else 0.0, detail)
                for (kind, route, new_route), (n, detail) in groups.items()
            ),
            key=lambda f: (-f.requests, f.kind, f.route),
        )
    )
    note = ""
    held = False
    if total < guard.min_requests:
        note = (
            f"only {total} requests in the last {traffic.window_s:.0f}s "
            f"(fewer than guard.min_requests = {guard.min_requests}): nothing to judge"
        )
    else:
        held = guard.enabled and affected / total >= guard.max_affected_share
    if approximate:
        warnings += (
            f"{approximate} requests were recorded by route prefix only (too many distinct "
            "paths); their replay is approximate",
        )
    return GuardReport(
        total, traffic.window_s, affected, guard.max_affected_share, held, findings, warnings, note
    )


def summarize(findings: Iterable[Finding]) -> str:
    """One log-line fragment: `no_endpoint 100.0% (route openai), ...`."""
    return ", ".join(
        f"{f.kind} {100 * f.share:.1f}% (route {f.route or '(none)'})" for f in findings
    )
