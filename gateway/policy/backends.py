"""Policy model: backends (endpoints, discovery, health, breakers, outliers, upstream TLS,
models). Routes are in `gateway.policy.routes`. Nothing here does I/O."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import (
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.core.serverload import parse_name
from gateway.policy.base import HostPort, PolicyModel, RedisUrl, UrlPath, fill_unset
from gateway.policy.llm import Models


class Endpoint(PolicyModel):
    address: HostPort = Field(description="host:port of one backend instance")
    weight: int = Field(
        default=1, ge=0, le=10000, description="relative share; 0 = out of rotation"
    )
    priority: int = Field(
        default=0,
        ge=0,
        le=7,
        description="priority level: 0 = primary; 1, 2, ... take traffic only as the levels "
        "before them lose members (e.g. another zone)",
    )


GrpcMethod = Annotated[
    str, Field(pattern=r"^/[A-Za-z0-9_.]+/[A-Za-z0-9_]+$", description="/pkg.Service/Method")
]


class Registry(PolicyModel):
    """Members published by heartbeats in Redis (`sluice heartbeat` beside each model server)."""

    redis: RedisUrl = Field(description="the registry's Redis")
    service: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="service name the heartbeats are published under",
    )
    version: str | None = Field(
        default=None, max_length=128, description="only members whose heartbeat `ver` is this"
    )
    poll_s: PositiveFloat = Field(default=1.0, le=60, description="how often Redis is read")
    stale_after_s: PositiveFloat = Field(
        default=5.0, description="a member whose heartbeat is older than this leaves rotation"
    )
    timeout_s: PositiveFloat = Field(default=0.5, le=10, description="deadline of each read")
    priority: int = Field(default=0, ge=0, le=7, description="priority level of these members")
    weight: int = Field(default=1, ge=1, le=10000, description="weight of each member")
    max_members: PositiveInt = Field(
        default=256, le=4096, description="members read per poll, at most"
    )


DnsName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9_]([A-Za-z0-9_\-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_\-]{0,62}))*\.?$",
        description="a DNS name",
    ),
]


class DnsDiscovery(PolicyModel):
    """Members from DNS: one per A/AAAA record of `name` (a Kubernetes headless Service answers
    with one per ready pod), or per SRV record of `srv` (its target's addresses, its port)."""

    name: DnsName | None = Field(
        default=None,
        description="name whose A and AAAA records are the members (without `resolvers`, a "
        "short name goes through resolv.conf's search list: `vllm` in a pod is the Service "
        "`vllm` of its namespace)",
        examples=["vllm.models.svc.cluster.local"],
    )
    srv: DnsName | None = Field(
        default=None,
        description="SRV name whose records give the members' names and ports (instead of `name`)",
        examples=["_http._tcp.vllm.models.svc.cluster.local"],
    )
    port: int = Field(default=8000, ge=1, le=65535, description="the members' port (with `name`)")
    interval_s: PositiveFloat = Field(
        default=5.0,
        ge=0.1,
        le=3600,
        description="between lookups at most: a shorter record TTL looks up sooner (at most "
        "once a second)",
    )
    timeout_s: PositiveFloat = Field(default=2.0, le=30, description="deadline of each lookup")
    resolvers: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=8,
        description="DNS servers as ip or ip:port (empty: the system's resolv.conf)",
        examples=[["10.96.0.10:53"]],
    )
    priority: int = Field(default=0, ge=0, le=7, description="priority level of these members")
    weight: int = Field(default=1, ge=1, le=10000, description="weight of each member")
    max_members: PositiveInt = Field(
        default=256, le=4096, description="members taken from one answer, at most"
    )

    @model_validator(mode="after")
    def _one_name(self) -> DnsDiscovery:
        if (self.name is None) == (self.srv is None):
            raise ValueError("set one of `name` (A/AAAA records) or `srv` (SRV records)")
        for r in self.resolvers:
            host, _, port = r.rpartition(":") if r.count(":") == 1 or r.startswith("[") else (
                r, "", "")  # fmt: skip
            try:
                ipaddress.ip_address(host.strip("[]"))
            except ValueError:
                raise ValueError(f"resolver {r!r}: want an IP address, or ip:port") from None
            if port and not (port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"resolver {r!r}: bad port")
        return self


class Discovery(PolicyModel):
    """Where members beyond `endpoints` come from: Redis heartbeats or DNS (one of them)."""

    registry: Registry | None = Field(default=None, description="members from Redis heartbeats")
    dns: DnsDiscovery | None = Field(
        default=None, description="members from DNS records (a Kubernetes headless Service)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> Discovery:
        if (self.registry is None) == (self.dns is None):
            raise ValueError("set one of `registry` or `dns`")
        return self


class HealthCheck(PolicyModel):
    """Active checks: HTTP `GET path` (2xx = pass) or gRPC `grpc.health.v1` (SERVING = pass)."""

    path: UrlPath = Field(
        default="/healthz?deep=true", description="HTTP backends: the path checked"
    )
    grpc_service: str = Field(
        default="", max_length=256, description="gRPC backends: service name ('' = server)"
    )
    interval_s: PositiveFloat = Field(default=30.0, description="between checks while passing")
    failing_interval_s: PositiveFloat = Field(
        default=2.0,
        description="between checks while failing (faster; default min(2, interval_s), at most "
        "interval_s)",
    )
    jitter: float = Field(default=0.1, ge=0, le=0.5, description="± spread of each interval")
    timeout_s: PositiveFloat = Field(default=2.0, description="a check slower than this fails")
    unhealthy_after: PositiveInt = Field(default=3, description="failed checks in a row → out")
    healthy_after: PositiveInt = Field(default=2, description="passing checks in a row → back")

    @model_validator(mode="after")
    def _derived(self) -> HealthCheck:
        fill_unset(self, failing_interval_s=min(2.0, self.interval_s))
        return self


class CircuitBreaker(PolicyModel):
    """Per member: trips on consecutive failures, an error ratio or a slow-call ratio; open for
    `open_s` (doubled at each re-open), then half-open probes decide."""

    consecutive_failures: int = Field(
        default=5, ge=0, le=10000, description="failures in a row that trip it (0 = off)"
    )
    error_ratio: float = Field(
        default=0.5, gt=0, le=1, description="failed share of the window that trips it"
    )
    slow_call_s: PositiveFloat = Field(
        default=10.0, description="a call slower than this to its first byte is slow"
    )
    slow_ratio: float = Field(
        default=0.5, gt=0, le=1, description="slow share of the window that trips it"
    )
    min_requests: PositiveInt = Field(
        default=20, description="results the window needs before ratios count"
    )
    window_s: PositiveFloat = Field(default=10.0, description="sliding window of the ratios")
    open_s: PositiveFloat = Field(
        default=5.0, description="first open time; doubles at each re-open, ±20 % jitter"
    )
    max_open_s: PositiveFloat = Field(
        default=60.0, description="open time cap (default max(60, open_s), at least open_s)"
    )
    half_open_probes: int = Field(
        default=3, ge=1, le=100, description="probes admitted half-open; all must succeed"
    )
    probe_timeout_s: PositiveFloat | None = Field(
        default=None, description="a probe without a first byte by then fails (default slow_call_s)"
    )

    @model_validator(mode="after")
    def _derived(self) -> CircuitBreaker:
        fill_unset(self, max_open_s=max(60.0, self.open_s))
        return self


class OutlierDetection(PolicyModel):
    timeout_ratio: float = Field(
        default=0.15, gt=0, le=1, description="timeout share over the window that ejects"
    )
    window_s: PositiveFloat = Field(default=120.0, description="sliding window")
    min_requests: PositiveInt = Field(default=20, description="results needed in the window")
    max_ejected: float = Field(
        default=0.1, ge=0, le=1, description="largest ejected share of the members (at least 1)"
    )
    ejection_s: PositiveFloat = Field(
        default=30.0, description="ejection time × times ejected, up to max_ejection_s"
    )
    max_ejection_s: PositiveFloat = Field(
        default=300.0,
        description="ejection time cap (default max(300, ejection_s), at least ejection_s)",
    )

    @model_validator(mode="after")
    def _derived(self) -> OutlierDetection:
        fill_unset(self, max_ejection_s=max(300.0, self.ejection_s))
        return self


class UpstreamTls(PolicyModel):
    """TLS toward a backend's members (HTTP pool, health checks, gRPC channels). Verification is
    on unless `insecure_skip_verify` is written; there is no plaintext fallback. The files are
    read when the policy is loaded: one that cannot be read or does not match is a policy
    error, and a changed file takes effect at the next policy change."""

    ca: str | None = Field(
        default=None,
        min_length=1,
        description="PEM file of the CA(s) that signed the backends' certificates (null = the "
        "system trust store)",
        examples=["/etc/sluice/upstream-ca.pem"],
    )
    server_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="name sent as SNI and checked against the backend's certificate (null = "
        "each endpoint's host)",
        examples=["vllm.internal"],
    )
    cert: str | None = Field(
        default=None,
        min_length=1,
        description="PEM client certificate (chain) for mutual TLS; needs `key`",
        examples=["/etc/sluice/client.crt"],
    )
    key: str | None = Field(
        default=None,
        min_length=1,
        description="PEM private key of `cert` (unencrypted); needs `cert`",
        examples=["/etc/sluice/client.key"],
    )
    insecure_skip_verify: bool = Field(
        default=False,
        description="do not verify the backend's certificate or name (tests only: anyone on "
        "the path can read and change the traffic; `sluice policy check` warns); HTTP backends "
        "only (grpcio cannot skip verification)",
    )

    # The gateway.tls.upstream.ClientTls these settings stand for, once built (by the loader,
    # which reports a bad file at its field, or at compilation for a policy made in code).
    _built: object = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _cert_and_key(self) -> UpstreamTls:
        if (self.cert is None) != (self.key is None):
            raise ValueError("set both `cert` and `key` (mutual TLS), or neither")
        return self

    def built(self) -> object:
        """What `keep` was handed (None before): see `gateway.tls.upstream.client_tls`."""
        return self._built

    def keep(self, built: object) -> None:
        self._built = built


class MetricNames(PolicyModel):
    """Metric names of the figures Sluice reads, overriding the preset's (null: the preset's).
    A name may carry label matchers: `name{key="value"}`."""

    running: str | None = Field(
        default=None, max_length=256, description="gauge of the requests the server runs now"
    )
    waiting: str | None = Field(
        default=None, max_length=256, description="gauge of the requests waiting in its queue"
    )
    kv_cache: str | None = Field(
        default=None, max_length=256, description="gauge of its KV-cache use, 0-1"
    )

    @model_validator(mode="after")
    def _well_formed(self) -> MetricNames:
        for figure in ("running", "waiting", "kv_cache"):
            v = getattr(self, figure)
            if v is not None:
                parse_name(figure, v)  # ValueError names the bad part
        return self


class LoadWeights(PolicyModel):
    """Requests in flight one unit of each server figure counts as in the pick (defaults need
    no tuning: a waiting request counts as two, a full KV cache as four)."""

    running: float = Field(
        default=1.0, ge=0, le=100, description="per request running that this gateway did not send"
    )
    waiting: float = Field(default=2.0, ge=0, le=100, description="per request waiting")
    kv_cache: float = Field(default=4.0, ge=0, le=1000, description="for a full KV cache")


class ServerMetrics(PolicyModel):
    """The model server's own figures (requests running, waiting, KV-cache use), scraped from
    its Prometheus page: the pick weighs them and the admission queue counts a member whose
    server is full as full."""

    preset: Literal["vllm", "sglang", "triton"] = Field(
        default="vllm", description="the server kind, whose metric names are used"
    )
    names: MetricNames = Field(
        default_factory=MetricNames, description="metric names overriding the preset's"
    )
    path: UrlPath = Field(default="/metrics", description="the page scraped")
    interval_ms: int = Field(
        default=100, ge=10, le=60_000, description="between scrapes of one member"
    )
    timeout_ms: int = Field(
        default=1000,
        ge=1,
        le=60_000,
        description="deadline of one scrape (default min(1000, 5 × interval_ms))",
    )
    max_bytes: int = Field(
        default=4_000_000, ge=1024, le=64_000_000, description="a larger page fails the scrape"
    )
    port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="the metrics port on each member's host (gRPC backends serve their metrics "
        "over HTTP on another port; null: the member's own port)",
    )
    address: HostPort | None = Field(
        default=None,
        description="one metrics address for every member (a sidecar scraping its own pod); "
        "overrides `port`",
    )
    weights: LoadWeights = Field(default_factory=LoadWeights, description="weights in the pick")

    @model_validator(mode="after")
    def _derived(self) -> ServerMetrics:
        fill_unset(self, timeout_ms=min(1000, 5 * self.interval_ms))
        return self


class BackendLoad(PolicyModel):
    metrics: ServerMetrics | None = Field(
        default=None, description="scrape the model server's own load figures (off)"
    )


class Backend(PolicyModel):
    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$", description="referenced by routes"
    )
    protocol: Literal["http", "grpc"] = Field(default="http", description="how Sluice talks to it")
    discovery: Discovery | None = Field(
        default=None, description="members added from a registry (Redis heartbeats) or DNS"
    )  # before `endpoints`: its validator looks at it
    endpoints: list[Endpoint] = Field(
        default_factory=list,
        max_length=4096,
        description="static members (need no Redis); at least one, or `discovery`",
    )
    tls: UpstreamTls | None = Field(
        default=None, description="reach the members over TLS (null = plaintext)"
    )
    health: HealthCheck | None = Field(default=None, description="active health checks (off)")
    breaker: CircuitBreaker | None = Field(
        default=None, description="circuit breaker per member (off)"
    )
    outlier: OutlierDetection | None = Field(
        default=None, description="outlier ejection on timeouts (off)"
    )
    panic_threshold: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="below this available share, members failing health checks or ejected are "
        "used again (breaker-open ones never); 0 = never",
    )
    unary_methods: list[GrpcMethod] = Field(
        default_factory=list,
        description="gRPC methods (/pkg.Service/Method) known to be unary: served by a cheaper "
        "unary handler; all others are proxied as stream-stream",
    )
    discover_unary: bool = Field(
        True,
        description="ask the gRPC backend's server reflection which methods are unary at load",
    )
    models: Models | None = Field(
        default=None,
        description="the models and LoRA adapters it serves, for `by_model` routes (null = "
        "any model)",
    )
    load: BackendLoad | None = Field(
        default=None, description="what the members' model servers say of their own load"
    )
    max_in_flight: PositiveInt | None = Field(
        default=None,
        le=100_000,
        description="requests one member runs at once (vLLM --max-num-seqs): with `admission`, "
        "the pool's queue dispatches up to this many per member (null: no fixed limit)",
    )

    @field_validator("endpoints")
    @classmethod
    def _some_members(cls, v: list[Endpoint], info: ValidationInfo) -> list[Endpoint]:
        if not v and info.data.get("discovery") is None:
            raise ValueError("needs at least one endpoint or `discovery`")
        return v
