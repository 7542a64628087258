"""Policy document schema. Every field is documented with its default; unknown fields are errors.

The model validates; `compiled.py` turns a valid model into the frozen lookup structures the hot
path uses. Nothing here does I/O.

Checks that need the whole document (unknown backend in a route, duplicate names, a route mixing
protocols) live in `reference_errors`, which returns each problem with the location of the
offending field, so that the loader can point at its line and column. `Policy` runs it in an
after-validator too (raising the first problem), unless the validation context holds
`{"defer_references": True}`, which the loader sets because it reports them all with positions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.policy.admission import Admission
from gateway.policy.auth import Auth, auth_reference_errors

# The sections live in their own modules and are re-exported here, where the rest of Sluice
# finds them.
from gateway.policy.backends import Backend as Backend
from gateway.policy.backends import HealthCheck as HealthCheck
from gateway.policy.backends import Registry as Registry
from gateway.policy.backends import UpstreamTls as UpstreamTls
from gateway.policy.base import Limits as Limits
from gateway.policy.base import Listeners as Listeners
from gateway.policy.base import Loc as Loc
from gateway.policy.base import PolicyModel, fill_unset
from gateway.policy.base import Timeouts as Timeouts
from gateway.policy.base import is_loopback as is_loopback
from gateway.policy.budgets import Budgets, budget_errors, budget_warnings
from gateway.policy.ratelimits import RateLimits
from gateway.policy.routes import Canary as Canary
from gateway.policy.routes import Retries as Retries
from gateway.policy.routes import Route as Route
from gateway.policy.routes import Sticky as Sticky
from gateway.policy.sections import AccessLog as AccessLog
from gateway.policy.sections import Datapath as Datapath
from gateway.policy.sections import Guard as Guard
from gateway.policy.sections import MockBackend as MockBackend
from gateway.policy.sections import Rollout as Rollout
from gateway.policy.sections import Tracing as Tracing
from gateway.policy.sections import TracingExporter as TracingExporter
from gateway.policy.store import SharedStore, effective_store, store_errors

FilterName = Literal[
    "request_id", "trace", "access_log", "auth", "ratelimit", "budget", "admission", "route"
]  # fmt: skip
DEFAULT_FILTERS: tuple[FilterName, ...] = (
    "request_id", "trace", "access_log", "auth", "ratelimit", "budget", "admission", "route",
)  # fmt: skip


class Policy(PolicyModel):
    version: Literal[1] = Field(default=1, description="schema version")
    listeners: Listeners = Field(default_factory=Listeners, description="where Sluice listens")
    limits: Limits = Field(default_factory=Limits, description="size/concurrency bounds")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="global timeouts")
    backends: list[Backend] = Field(default_factory=list, description="upstream pools")
    routes: list[Route] = Field(default_factory=list, description="first match wins")
    filters: list[FilterName] = Field(
        default_factory=lambda: list(DEFAULT_FILTERS),
        description="filter order of the chain",
    )
    access_log: AccessLog = Field(default_factory=AccessLog, description="structured access log")
    mock_backend: MockBackend = Field(default_factory=MockBackend, description="simulated backend")
    datapath: Datapath = Field(default_factory=Datapath, description="eBPF classifier")
    tracing: Tracing = Field(default_factory=Tracing, description="OpenTelemetry tail sampling")
    guard: Guard = Field(default_factory=Guard, description="change guard of reloads")
    rollout: Rollout | None = Field(
        default=None,
        description="roll this policy out in stages when it replaces a running one "
        "(null = all at once)",
    )
    force: bool = Field(
        default=False,
        description="apply this policy even if the change guard would hold it (for automation; "
        "remove it again, or every later reload of the file skips the guard too)",
    )
    checksum: str | None = Field(
        default=None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="sha256 of the file without this line (`sluice policy checksum FILE "
        "--write`); a file that does not match is refused, so a half-written file never loads",
        examples=["sha256:" + "0" * 64],
    )
    end_marker: str | None = Field(
        default=None,
        min_length=1,
        description="a line the file must end with (put this field at the top): a file cut "
        "short while being written lacks it and is refused",
        examples=["# end of policy"],
    )
    auth: Auth | None = Field(default=None, description="JWT authentication (null = off)")
    rate_limits: RateLimits | None = Field(
        default=None, description="adaptive request and LLM-token limits, overload colours"
    )
    admission: Admission | None = Field(
        default=None,
        description="queue requests fairly per backend pool instead of refusing at its "
        "concurrency limit (null: refuse, 503)",
    )
    store: SharedStore | None = Field(
        default=None,
        description="the store shared by every replica (null: each replica on its own, unless "
        "`rate_limits.store` names Redis): with it, backend slots (`max_in_flight`), rate "
        "limits, fairness counters and token budgets hold for the fleet",
    )
    budgets: Budgets | None = Field(
        default=None, description="token budgets per key over days, weeks, months (null = off)"
    )

    @field_validator("filters")
    @classmethod
    def _filter_order(cls, v: list[str]) -> list[str]:
        dup = sorted({f for f in v if v.count(f) > 1})
        if dup:
            raise ValueError(f"each filter may appear once; repeated: {', '.join(dup)}")
        if "route" not in v:
            raise ValueError("the filter chain must contain 'route' (nothing is forwarded without)")
        return v

    @model_validator(mode="after")
    def _derived(self) -> Policy:
        # Defaults that depend on another section (runs before the reference checks).
        cap = self.limits.grpc_max_metadata_bytes
        fill_unset(self.datapath, max_header_block_bytes=max(65536, 2 * cap))
        headers = max(self.limits.max_header_bytes, cap)  # HPACK output stays below either
        fill_unset(self.limits.http2, max_header_list_bytes=max(32768, 2 * headers))
        return self

    @model_validator(mode="after")
    def _references(self, info: ValidationInfo) -> Policy:
        if info.context and info.context.get("defer_references"):
            return self
        problems = reference_errors(self)
        if problems:
            loc, msg = problems[0]
            raise ValueError(f"{format_loc(loc)}: {msg}")
        return self


def format_loc(loc: Loc) -> str:
    """`("routes", 0, "backend")` → `routes[0].backend`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def reference_errors(p: Policy) -> list[tuple[Loc, str]]:
    """Problems that span fields, each with the location of the field at fault, in file order."""
    errors: list[tuple[Loc, str]] = []
    protocols: dict[str, str] = {}
    for j, b in enumerate(p.backends):
        if b.name in protocols:
            errors.append((("backends", j, "name"), f"duplicate backend name {b.name!r}"))
        protocols.setdefault(b.name, b.protocol)
        if b.unary_methods and b.protocol != "grpc":
            errors.append(
                (("backends", j, "unary_methods"), "unary_methods only apply to grpc backends")
            )
        errors += _backend_errors(j, b)
    seen_routes: set[str] = set()
    for i, r in enumerate(p.routes):
        if r.name in seen_routes:
            errors.append((("routes", i, "name"), f"duplicate route name {r.name!r}"))
        seen_routes.add(r.name)
        refs: list[tuple[Loc, str]] = (
            [(("routes", i, "backend"), r.backend)]
            if r.backend is not None
            else [
                (("routes", i, "backends", k, "backend"), w.backend)
                for k, w in enumerate(r.backends)
            ]
        )
        used: set[str] = set()
        for loc, name in refs:
            if name not in protocols:
                known = ", ".join(sorted(protocols)) or "none defined"
                errors.append((loc, f"unknown backend {name!r} (known: {known})"))
            else:
                used.add(protocols[name])
        if len(used) > 1:
            errors.append((("routes", i, "backends"), "a route cannot mix http and grpc backends"))
        elif used and r.match.protocol != "any" and used != {r.match.protocol}:
            errors.append(
                (
                    ("routes", i, "match", "protocol"),
                    f"route matches {r.match.protocol} requests but its backends speak "
                    f"{used.pop()}",
                )
            )
        if r.strip_prefix and not r.strip_prefix.startswith("/"):
            errors.append((("routes", i, "strip_prefix"), "must start with '/'"))
        errors += _route_errors(i, r)
    errors += _model_route_auth_errors(p.routes)
    errors += auth_reference_errors(p.auth, [r.auth for r in p.routes], p.filters)
    hb, cap = p.datapath.max_header_block_bytes, p.limits.grpc_max_metadata_bytes
    if p.datapath.enabled and hb and hb < 2 * cap:  # HPACK output stays below the metadata size
        errors.append(
            (
                ("datapath", "max_header_block_bytes"),
                f"{hb} would drop clients whose metadata fits limits.grpc_max_metadata_bytes "
                f"({cap}): use at least {2 * cap}, or 0 to turn the check off",
            )
        )
    errors += _tls_errors(p)
    if p.tracing.enabled and "trace" not in p.filters:
        errors.append((("filters",), "tracing is enabled: list 'trace' in filters"))
    errors += store_errors(p.store, p.rate_limits)
    if p.rate_limits is not None and "ratelimit" not in p.filters:
        errors.append((("filters",), "rate_limits is configured: list 'ratelimit' in filters"))
    errors += budget_errors(p.budgets, list(p.filters))
    if p.admission is not None:
        if "admission" not in p.filters:
            errors.append((("filters",), "admission is configured: list 'admission' in filters"))
        elif p.filters.index("admission") > p.filters.index("route"):
            errors.append((("filters",), "'admission' must come before 'route' (a member is "
                           "picked when the queue dispatches the request)"))  # fmt: skip
    return errors


def _tls_errors(p: Policy) -> list[tuple[Loc, str]]:
    errors: list[tuple[Loc, str]] = []
    lst = p.listeners
    if lst.admin is not None and lst.admin.tls is not None:
        errors.append((("listeners", "admin", "tls"), "the admin listener serves plaintext only"))
    if (
        lst.grpc is not None
        and lst.grpc.engine == "grpcio"
        and lst.grpc.tls is not None
        and lst.grpc.tls.client_cert == "optional"
    ):
        errors.append(
            (
                ("listeners", "grpc", "tls", "client_cert"),
                "grpcio either requires a client certificate or does not ask for one: use "
                "off or required on the gRPC listener, or its engine h2",
            )
        )
    return errors


def reference_warnings(p: Policy) -> list[tuple[Loc, str]]:
    """Settings that are valid but unsafe, each with the location of the field (`sluice policy
    check` prints them; they do not stop a load)."""
    return [
        (
            ("backends", j, "tls", "insecure_skip_verify"),
            f"backend {b.name!r} does not verify its members' certificates: anyone on the path "
            "can read and change its traffic",
        )
        for j, b in enumerate(p.backends)
        if b.tls is not None and b.tls.insecure_skip_verify
    ] + budget_warnings(p.budgets, effective_store(p.store, p.rate_limits))


def _backend_errors(j: int, b: Backend) -> list[tuple[Loc, str]]:
    errors: list[tuple[Loc, str]] = []
    seen: set[str] = set()
    for k, e in enumerate(b.endpoints):
        if e.address in seen:
            errors.append((("backends", j, "endpoints", k, "address"), "duplicate address"))
        seen.add(e.address)
    if b.tls is not None and b.tls.insecure_skip_verify and b.protocol == "grpc":
        errors.append(
            (
                ("backends", j, "tls", "insecure_skip_verify"),
                "grpc backends cannot skip verification (grpcio has no such switch): set `ca` "
                "to the CA that signed the backend's certificate",
            )
        )
    if b.models is not None and b.models.discover and b.protocol != "http":
        errors.append(
            (("backends", j, "models", "discover"), "models are discovered on http backends only "
             "(GET /v1/models): list `names` for a grpc backend")
        )  # fmt: skip
    h = b.health
    if h is not None and h.failing_interval_s > h.interval_s:
        errors.append(
            (("backends", j, "health", "failing_interval_s"), "must not exceed interval_s")
        )
    br = b.breaker
    if br is not None and br.max_open_s < br.open_s:
        errors.append((("backends", j, "breaker", "max_open_s"), "must not be below open_s"))
    o = b.outlier
    if o is not None and o.max_ejection_s < o.ejection_s:
        errors.append(
            (("backends", j, "outlier", "max_ejection_s"), "must not be below ejection_s")
        )
    return errors


def _route_errors(i: int, r: Route) -> list[tuple[Loc, str]]:
    errors: list[tuple[Loc, str]] = []
    names = [w.backend for w in r.backends] if r.backend is None else [r.backend]
    if r.canary is not None:
        if len(names) < 2:
            errors.append(
                (("routes", i, "canary"), "a canary needs a `backends` split of two or more")
            )
        elif r.canary.backend not in names:
            errors.append(
                (
                    ("routes", i, "canary", "backend"),
                    f"{r.canary.backend!r} is not one of this route's backends "
                    f"({', '.join(names)})",
                )
            )
    if len(set(names)) != len(names):
        errors.append((("routes", i, "backends"), "a backend appears twice in the split"))
    return errors


def _model_route_auth_errors(routes: list[Route]) -> list[tuple[Loc, str]]:
    """A route with `match.model` is decided on the body, after the auth filter authorised the
    request against the first route its head matches: every later route that may take the same
    requests (same listener, one path prefix within the other) must ask for the same `auth`,
    or a request could be let in under one route's setting and served by another's."""
    errors: list[tuple[Loc, str]] = []
    for i, r in enumerate(routes):
        if not r.match.model:
            continue
        for later in routes[i + 1 :]:
            m, n = r.match, later.match
            same_listener = "any" in (m.protocol, n.protocol) or m.protocol == n.protocol
            a, b = m.path_prefix, n.path_prefix
            if same_listener and (a.startswith(b) or b.startswith(a)) and later.auth != r.auth:
                errors.append((
                    ("routes", i, "auth"),
                    f"route {r.name!r} matches on the model and so is decided after "
                    f"authentication: give it the same `auth` as route {later.name!r}, which "
                    "may take the same requests",
                ))  # fmt: skip
                break
    return errors
