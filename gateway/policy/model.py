"""Policy document schema. Every field is documented with its default; unknown fields are errors.

The model validates; `compiled.py` turns a valid model into the frozen lookup structures the hot
path uses. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

HostPort = Annotated[
    str,
    Field(
        pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):[0-9]{1,5}$",
        description="host:port; IPv6 in brackets",
    ),
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listener(_Model):
    host: str = Field("0.0.0.0", description="address to bind")
    port: int = Field(ge=0, le=65535, description="port to bind; 0 picks a free one")


class Listeners(_Model):
    http: Listener | None = Field(
        default_factory=lambda: Listener(port=8080), description="HTTP/1.1 ingress (null = off)"
    )
    grpc: Listener | None = Field(
        default_factory=lambda: Listener(port=8081), description="gRPC ingress (null = off)"
    )
    admin: Listener | None = Field(
        default_factory=lambda: Listener(host="127.0.0.1", port=9901),
        description="admin listener: /healthz /readyz /metrics /status /admin/policy",
    )


class Limits(_Model):
    """Size and concurrency bounds of the ingress."""

    max_header_bytes: PositiveInt = Field(16384, description="total request header bytes (431)")
    max_header_count: PositiveInt = Field(100, description="number of request headers (431)")
    max_line_bytes: PositiveInt = Field(8190, description="request line / one header line")
    max_body_bytes: PositiveInt = Field(
        16 * 1024 * 1024, description="request body bytes (413); also the gRPC request message cap"
    )
    max_response_header_bytes: PositiveInt = Field(
        65536, description="upstream response header bytes before 502"
    )
    grpc_max_message_bytes: PositiveInt = Field(
        16 * 1024 * 1024, description="largest gRPC message either way"
    )
    grpc_max_concurrent_streams: PositiveInt = Field(
        100, description="HTTP/2 max concurrent streams per gRPC connection"
    )
    grpc_max_metadata_bytes: PositiveInt = Field(16384, description="gRPC metadata bytes")
    grpc_keepalive_min_ping_interval_s: PositiveFloat = Field(
        60.0, description="pings closer than this without data count as strikes (GOAWAY)"
    )
    max_connections_per_backend: PositiveInt = Field(
        256, description="upstream HTTP connections per endpoint; excess requests wait"
    )
    max_idle_connections_per_backend: int = Field(
        32, ge=0, description="idle upstream keep-alive connections kept per endpoint"
    )


class Timeouts(_Model):
    connect_s: PositiveFloat = Field(2.0, description="TCP connect to a backend (504)")
    first_byte_s: PositiveFloat = Field(
        30.0, description="from request sent to response headers (504); LLM prefill can be slow"
    )
    idle_s: PositiveFloat = Field(
        60.0, description="longest silence between body chunks either way (504 or cut)"
    )
    total_s: PositiveFloat = Field(600.0, description="whole request, streams included (504)")
    header_read_s: PositiveFloat = Field(10.0, description="client must send headers within this")
    keepalive_s: PositiveFloat = Field(75.0, description="idle client keep-alive connection")
    upstream_idle_s: PositiveFloat = Field(
        30.0, description="idle upstream keep-alive connection is closed after this"
    )
    drain_s: PositiveFloat = Field(
        30.0, description="on SIGTERM, in-flight requests (streams too) get this long to finish"
    )


class Endpoint(_Model):
    address: HostPort = Field(description="host:port of one backend instance")
    weight: int = Field(1, ge=0, le=10000, description="relative share; 0 = out of rotation")


class Backend(_Model):
    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$", description="referenced by routes"
    )
    protocol: Literal["http", "grpc"] = Field("http", description="how Sluice talks to it")
    endpoints: list[Endpoint] = Field(min_length=1, description="instances, weighted round robin")
    unary_methods: list[str] = Field(
        default_factory=list,
        description="gRPC methods (/pkg.Service/Method) known to be unary: served by a cheaper "
        "unary handler; all others are proxied as stream-stream",
    )
    discover_unary: bool = Field(
        True,
        description="ask the gRPC backend's server reflection which methods are unary at load",
    )


class HeaderMatch(_Model):
    name: str = Field(min_length=1, description="header (HTTP) or metadata key (gRPC)")
    value: str | None = Field(None, description="exact value; null = present with any value")


class RouteMatch(_Model):
    protocol: Literal["http", "grpc", "any"] = Field("any", description="which listener")
    path_prefix: str = Field("/", description="HTTP path prefix, or gRPC '/pkg.Service/' prefix")
    methods: list[str] = Field(
        default_factory=list, description="HTTP methods; empty = any (gRPC is always POST)"
    )
    headers: list[HeaderMatch] = Field(default_factory=list, description="all must match")


class WeightedBackend(_Model):
    backend: str = Field(description="backend name")
    weight: int = Field(1, ge=0, le=10000, description="relative share of this route's traffic")


class Route(_Model):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$", description="metrics label")
    match: RouteMatch = Field(
        default_factory=RouteMatch, description="first route that matches wins"
    )
    backend: str | None = Field(None, description="one backend (or use `backends`)")
    backends: list[WeightedBackend] = Field(
        default_factory=list, description="weighted split between backends"
    )
    timeouts: Timeouts | None = Field(None, description="overrides the global timeouts")
    strip_prefix: str = Field("", description="removed from the HTTP path before forwarding")

    @model_validator(mode="after")
    def _one_target(self) -> Route:
        if (self.backend is None) == (not self.backends):
            raise ValueError("set exactly one of `backend` or `backends`")
        return self


class AccessLog(_Model):
    enabled: bool = Field(True, description="one JSON line per request on stderr")
    headers: list[str] = Field(
        default_factory=list,
        description="extra request headers to log; authorization/cookie are never logged",
    )


class MockBackend(_Model):
    """The built-in simulated inference server, started in-process (for `make run` and demos)."""

    enabled: bool = Field(False, description="start the simulated backend inside the gateway")
    http: HostPort | None = Field("127.0.0.1:18000", description="its HTTP listener")
    grpc: HostPort | None = Field("127.0.0.1:18001", description="its gRPC listener")
    ttft_ms: float = Field(50.0, ge=0, description="time to first token")
    token_delay_ms: float = Field(10.0, ge=0, description="delay between streamed tokens")
    completion_tokens: int = Field(16, ge=1, le=100000, description="tokens per completion")


class Datapath(_Model):
    """eBPF TC classifier (filled in by the datapath issue)."""

    enabled: bool = Field(False, description="attach the TC classifier")
    required: bool = Field(False, description="refuse to start if it cannot attach")
    interface: str = Field("eth0", description="interface to attach to")


FilterName = Literal["request_id", "access_log", "route"]


class Policy(_Model):
    version: Literal[1] = Field(1, description="schema version")
    listeners: Listeners = Field(default_factory=Listeners, description="where Sluice listens")
    limits: Limits = Field(default_factory=Limits, description="size/concurrency bounds")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="global timeouts")
    backends: list[Backend] = Field(default_factory=list, description="upstream pools")
    routes: list[Route] = Field(default_factory=list, description="first match wins")
    filters: list[FilterName] = Field(
        default_factory=lambda: ["request_id", "access_log", "route"],
        description="filter order of the chain",
    )
    access_log: AccessLog = Field(default_factory=AccessLog, description="structured access log")
    mock_backend: MockBackend = Field(default_factory=MockBackend, description="simulated backend")
    datapath: Datapath = Field(default_factory=Datapath, description="eBPF classifier")

    @model_validator(mode="after")
    def _references(self) -> Policy:
        names = [b.name for b in self.backends]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate backend names: {sorted(dup)}")
        known = set(names)
        for i, r in enumerate(self.routes):
            targets = [r.backend] if r.backend else [w.backend for w in r.backends]
            for t in targets:
                if t not in known:
                    raise ValueError(f"routes[{i}] ({r.name}): unknown backend {t!r}")
        return self
