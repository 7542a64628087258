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

import ipaddress
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.policy.auth import Auth, RouteAuthSetting, auth_reference_errors

Loc = tuple[str | int, ...]

HostPort = Annotated[
    str,
    Field(
        pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):[0-9]{1,5}$",
        description="host:port; IPv6 in brackets",
    ),
]


def is_loopback(host: str) -> bool:
    """True for `localhost` or a loopback address (IPv6 with or without brackets)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Model(BaseModel):
    # inf/nan would pass PositiveFloat (`.inf` is valid YAML) and disable a timeout by accident.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Listener(_Model):
    host: str = Field(default="0.0.0.0", description="address to bind")
    port: int = Field(ge=0, le=65535, description="port to bind; 0 picks a free one")
    engine: Literal["aiohttp", "native"] = Field(
        default="native",
        description="HTTP engine (http listener only): native (default), an asyncio.Protocol + "
        "httptools server, or aiohttp's server (~30 µs/request more CPU; the same behaviour, "
        "checked by a differential fuzz test, except for known aiohttp parser limits)",
    )


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

    max_header_bytes: PositiveInt = Field(
        default=16384, description="total request header bytes (431)"
    )
    max_header_count: PositiveInt = Field(
        default=100, description="number of request headers (431)"
    )
    max_line_bytes: PositiveInt = Field(default=8190, description="request line / one header line")
    max_body_bytes: PositiveInt = Field(
        default=16 * 1024 * 1024,
        description="request body bytes (413); also the gRPC request message cap",
    )
    max_response_header_bytes: PositiveInt = Field(
        default=65536, description="upstream response header bytes before 502"
    )
    grpc_max_message_bytes: PositiveInt = Field(
        default=16 * 1024 * 1024, description="largest gRPC message either way"
    )
    grpc_max_concurrent_streams: PositiveInt = Field(
        default=1000,
        description="HTTP/2 max concurrent streams per gRPC connection; grpc clients do not "
        "queue above it (they get UNAVAILABLE), so keep it above the busiest client's burst",
    )
    grpc_max_metadata_bytes: PositiveInt = Field(default=16384, description="gRPC metadata bytes")
    grpc_max_upstream_metadata_bytes: PositiveInt = Field(
        default=1 << 20,
        description="gRPC metadata bytes a backend may send (a long status message arrives "
        "whole, then its details are cut to 4096 characters and the rest of the metadata to "
        "grpc_max_metadata_bytes for the client)",
    )
    grpc_keepalive_min_ping_interval_s: PositiveFloat = Field(
        default=60.0, description="pings closer than this without data count as strikes (GOAWAY)"
    )
    max_connections_per_backend: PositiveInt = Field(
        default=256, description="upstream HTTP connections per endpoint; excess requests wait"
    )
    max_idle_connections_per_backend: int = Field(
        default=32, ge=0, description="idle upstream keep-alive connections kept per endpoint"
    )
    max_buffered_body_bytes: PositiveInt = Field(
        default=1024 * 1024,
        description="request bodies up to this size are read whole (within body_read_s) "
        "before an upstream connection is taken; JSON bodies up to it are parsed for the body "
        "phase (model, max_tokens, stream). Larger bodies are streamed through unchanged",
    )
    max_streamed_uploads_per_backend: PositiveInt = Field(
        default=64,
        description="upstream connections per endpoint that may carry a streamed (larger than "
        "max_buffered_body_bytes) request body at once; more get 503, so slow uploads cannot "
        "take every connection",
    )
    max_event_bytes: PositiveInt = Field(
        default=1024 * 1024,
        description="longest SSE line / JSON response body the response phase parses; past it "
        "the response passes through unparsed",
    )


class Timeouts(_Model):
    connect_s: PositiveFloat = Field(default=2.0, description="TCP connect to a backend (504)")
    first_byte_s: PositiveFloat = Field(
        default=30.0,
        description="from request sent to response headers (504); LLM prefill can be slow",
    )
    idle_s: PositiveFloat = Field(
        default=60.0,
        description="longest silence between body chunks either way (504 or cut); also how "
        "long a client that stopped reading may stall a response before it is cut both ways",
    )
    total_s: PositiveFloat = Field(
        default=600.0, description="whole request, streams included (504)"
    )
    header_read_s: PositiveFloat = Field(
        default=10.0, description="client must send headers within this"
    )
    keepalive_s: PositiveFloat = Field(
        default=75.0, description="idle client keep-alive connection"
    )
    upstream_idle_s: PositiveFloat = Field(
        default=30.0, description="idle upstream keep-alive connection is closed after this"
    )
    drain_s: PositiveFloat = Field(
        default=30.0,
        description="on SIGTERM, in-flight requests (streams too) get this long to finish",
    )
    body_read_s: PositiveFloat = Field(
        default=30.0,
        description="a buffered request body (see limits.max_buffered_body_bytes) must arrive "
        "within this (408)",
    )


class Endpoint(_Model):
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


RedisUrl = Annotated[
    str,
    Field(
        pattern=r"^(redis|rediss|unix)://\S+$",
        max_length=1024,
        description="redis://[user:password@]host:port/db, rediss:// for TLS, or unix://path",
    ),
]


class Registry(_Model):
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


class Discovery(_Model):
    registry: Registry = Field(description="members from Redis heartbeats")


class HealthCheck(_Model):
    """Active checks: HTTP `GET path` (2xx = pass) or gRPC `grpc.health.v1` (SERVING = pass)."""

    path: str = Field(
        default="/healthz?deep=true",
        pattern=r"^/[\x21-\x7e]*$",
        max_length=1024,
        description="HTTP backends: the path checked",
    )
    grpc_service: str = Field(
        default="", max_length=256, description="gRPC backends: service name ('' = server)"
    )
    interval_s: PositiveFloat = Field(default=30.0, description="between checks while passing")
    failing_interval_s: PositiveFloat = Field(
        default=2.0, description="between checks while failing (faster)"
    )
    jitter: float = Field(default=0.1, ge=0, le=0.5, description="± spread of each interval")
    timeout_s: PositiveFloat = Field(default=2.0, description="a check slower than this fails")
    unhealthy_after: PositiveInt = Field(default=3, description="failed checks in a row → out")
    healthy_after: PositiveInt = Field(default=2, description="passing checks in a row → back")


class CircuitBreaker(_Model):
    """Per member: trips on consecutive failures, error ratio or slow-call ratio; see README."""

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
    max_open_s: PositiveFloat = Field(default=60.0, description="open time cap")
    half_open_probes: int = Field(
        default=3, ge=1, le=100, description="probes admitted half-open; all must succeed"
    )
    probe_timeout_s: PositiveFloat | None = Field(
        default=None, description="a probe without a first byte by then fails (default slow_call_s)"
    )


class OutlierDetection(_Model):
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
    max_ejection_s: PositiveFloat = Field(default=300.0, description="ejection time cap")


class Backend(_Model):
    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$", description="referenced by routes"
    )
    protocol: Literal["http", "grpc"] = Field(default="http", description="how Sluice talks to it")
    discovery: Discovery | None = Field(
        default=None, description="members added from a registry (Redis heartbeats)"
    )  # before `endpoints`: its validator looks at it
    endpoints: list[Endpoint] = Field(
        default_factory=list,
        max_length=4096,
        description="static members (need no Redis); at least one, or `discovery`",
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

    @field_validator("endpoints")
    @classmethod
    def _some_members(cls, v: list[Endpoint], info: ValidationInfo) -> list[Endpoint]:
        if not v and info.data.get("discovery") is None:
            raise ValueError("needs at least one endpoint or `discovery`")
        return v


class HeaderMatch(_Model):
    name: str = Field(min_length=1, description="header (HTTP) or metadata key (gRPC)")
    value: str | None = Field(
        default=None, description="exact value; null = present with any value"
    )


class RouteMatch(_Model):
    protocol: Literal["http", "grpc", "any"] = Field(default="any", description="which listener")
    path_prefix: str = Field(
        default="/", description="HTTP path prefix, or gRPC '/pkg.Service/' prefix"
    )
    methods: list[str] = Field(
        default_factory=list, description="HTTP methods; empty = any (gRPC is always POST)"
    )
    headers: list[HeaderMatch] = Field(default_factory=list, description="all must match")


class WeightedBackend(_Model):
    backend: str = Field(description="backend name")
    weight: int = Field(
        default=1, ge=0, le=10000, description="relative share of this route's traffic"
    )


class Canary(_Model):
    """The canary's p95 and error ratio against the stable version's; a breach sets its weight
    to 0 until a policy change to this route's canary or weights."""

    backend: str = Field(description="which of the route's backends is the canary")
    p95_ms: PositiveFloat = Field(default=200.0, description="p95 time to first byte allowed")
    max_error_ratio: float = Field(default=0.02, ge=0, le=1, description="error share allowed")
    window_s: PositiveFloat = Field(default=60.0, description="sliding window compared")
    min_requests: PositiveInt = Field(
        default=20, description="canary results needed in the window before it is judged"
    )
    override_header: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9\-_]+$",
        description="header forcing the choice: 1/true/canary → canary, 0/false/stable → not",
    )


RetryOn = Literal["connect_failure", "unavailable"]
RETRY_ON: tuple[RetryOn, ...] = ("connect_failure", "unavailable")


class Retries(_Model):
    """Retry where safe: connect failures, or 503 / UNAVAILABLE before any byte reached the
    client; never once a response started; bounded by a budget."""

    attempts: int = Field(default=2, ge=1, le=5, description="tries in total, the first included")
    budget_ratio: float = Field(
        default=0.2, ge=0, le=1, description="retries in flight ≤ this share of active requests"
    )
    min_retries: int = Field(
        default=3, ge=0, le=1000, description="retries in flight always allowed (budget floor)"
    )
    per_try_timeout_s: PositiveFloat | None = Field(
        default=None, description="each try's deadline up to its first response byte"
    )
    retry_on: list[RetryOn] = Field(
        default_factory=lambda: list(RETRY_ON),
        description="connect_failure; unavailable (HTTP 503 / gRPC UNAVAILABLE)",
    )


class Sticky(_Model):
    header: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9\-_]+$",
        description="hash this header (e.g. a user id): the same value keeps its backend and "
        "member; requests without it are balanced normally",
    )


class Route(_Model):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$", description="metrics label")
    match: RouteMatch = Field(
        default_factory=RouteMatch, description="first route that matches wins"
    )
    backend: str | None = Field(default=None, description="one backend (or use `backends`)")
    backends: list[WeightedBackend] = Field(
        default_factory=list, description="weighted split between backends"
    )
    timeouts: Timeouts | None = Field(default=None, description="overrides the global timeouts")
    strip_prefix: str = Field(
        default="", description="removed from the HTTP path before forwarding"
    )
    canary: Canary | None = Field(default=None, description="guard of a canary backend (off)")
    retries: Retries | None = Field(default=None, description="retries where safe (off)")
    sticky: Sticky | None = Field(
        default=None, description="header-hash stickiness instead of least-loaded choice"
    )
    auth: RouteAuthSetting | None = Field(
        default=None,
        description="required | optional | off, or {required, claims, providers}; "
        "null = `auth.default`",
    )

    @model_validator(mode="after")
    def _one_target(self) -> Route:
        if (self.backend is None) == (not self.backends):
            raise ValueError("set exactly one of `backend` or `backends`")
        return self


class AccessLog(_Model):
    enabled: bool = Field(default=True, description="one JSON line per request on stderr")
    headers: list[str] = Field(
        default_factory=list,
        description="extra request headers to log; authorization/cookie are never logged",
    )


class MockBackend(_Model):
    """The built-in simulated inference server, started in-process (for `make run` and demos)."""

    enabled: bool = Field(
        default=False, description="start the simulated backend inside the gateway"
    )
    http: HostPort | None = Field(default="127.0.0.1:18000", description="its HTTP listener")
    grpc: HostPort | None = Field(default="127.0.0.1:18001", description="its gRPC listener")
    admin: HostPort | None = Field(
        default="127.0.0.1:18002",
        description="its admin API (/admin/knobs, /admin/stats, /admin/reset), on a listener of "
        "its own, loopback only: never route to it (null = off)",
    )
    ttft_ms: float = Field(default=50.0, ge=0, description="time to first token")
    token_delay_ms: float = Field(default=10.0, ge=0, description="delay between streamed tokens")
    completion_tokens: int = Field(default=16, ge=1, le=100000, description="tokens per completion")

    @field_validator("admin")
    @classmethod
    def _admin_on_loopback(cls, v: str | None) -> str | None:
        if v is not None and not is_loopback(v.rpartition(":")[0]):
            raise ValueError("the simulated backend's admin API listens on loopback only")
        return v


class DatapathBudget(_Model):
    """A token bucket: `rate` per second, up to `burst` at once; rate 0 means unlimited."""

    rate: int = Field(
        default=0, ge=0, le=4_000_000_000, description="tokens per second (0 = unlimited)"
    )
    burst: int = Field(
        default=0, ge=0, le=4_000_000_000, description="bucket size (0 = same as rate)"
    )


class Datapath(_Model):
    """eBPF TC classifier: per-flow counters, per-source admission, deny list, rapid reset."""

    enabled: bool = Field(default=False, description="attach the TC classifier")
    required: bool = Field(default=False, description="refuse to start if it cannot attach")
    interface: str = Field(default="eth0", description="interface to attach to")
    egress: bool = Field(default=True, description="also attach on egress (priority-class marking)")
    h2c_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(
        default_factory=lambda: [8081],
        description="local ports carrying cleartext h2c: HTTP/2 frames are counted there",
    )
    admission_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(
        default_factory=list,
        description="local ports where SYN budgets and the deny list apply (empty = h2c_ports)",
    )
    syn_budget: DatapathBudget = Field(
        default_factory=DatapathBudget, description="new connections per source address (SYN)"
    )
    stream_budget: DatapathBudget = Field(
        default_factory=DatapathBudget,
        description="new HTTP/2 streams (HEADERS) per source address",
    )
    deny_ttl_s: PositiveFloat = Field(
        default=30.0, description="how long a source shed in the kernel on red stays denied"
    )
    rapid_reset_window_s: PositiveFloat = Field(
        default=1.0, description="window over which RST_STREAM / HEADERS is measured per flow"
    )
    rapid_reset_ratio: float = Field(
        default=0.8,
        gt=0,
        le=10,
        description="RST_STREAM / HEADERS ratio at which a flow is dropped",
    )
    rapid_reset_min_headers: PositiveInt = Field(
        default=100, description="HEADERS needed in the window before a flow can be judged"
    )
    max_header_block_bytes: int = Field(
        default=65536,
        ge=0,
        le=1 << 30,
        description="bytes of one HTTP/2 header block (HEADERS + CONTINUATION) before the flow "
        "is dropped (CONTINUATION flood); at least twice limits.grpc_max_metadata_bytes; 0 = off",
    )
    ping_flood_max: int = Field(
        default=1000,
        ge=0,
        le=1 << 30,
        description="PING frames a flow may send per ping_flood_window_s before it is dropped "
        "(PING flood); 0 = off",
    )
    ping_flood_window_s: PositiveFloat = Field(
        default=10.0, description="window over which PING frames are counted per flow"
    )
    class_priority: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: {"critical": 6, "high": 4, "normal": 0, "low": 1},
        description="priority class -> skb->priority set on egress (0 = leave it); at most 8",
    )
    port_class: dict[int, str] = Field(
        default_factory=dict, description="local port -> priority class of its egress packets"
    )
    max_flows: PositiveInt = Field(default=65536, description="flow table size (-DMAX_FLOWS)")
    max_sources: PositiveInt = Field(
        default=65536, description="per-source table size (-DMAX_SOURCES)"
    )
    max_deny: PositiveInt = Field(default=16384, description="deny list size (-DMAX_DENY)")
    sync_interval_s: PositiveFloat = Field(
        default=1.0, description="how often budgets are written and counters read into metrics"
    )


class TracingExporter(_Model):
    """Where kept traces go. Unset fields come from the standard OpenTelemetry environment
    variables (OTEL_EXPORTER_OTLP_TRACES_* or OTEL_EXPORTER_OTLP_*: endpoint, protocol,
    headers, timeout, certificates), then from the OTLP defaults."""

    protocol: Literal["grpc", "http/protobuf"] | None = Field(
        default=None,
        description="OTLP transport; null = OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf",
    )
    endpoint: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="collector URL (http:// or https://): http://otel-collector:4317 (grpc) or "
        "http://otel-collector:4318/v1/traces (http); null = the OTEL_* variables, else "
        "localhost on the protocol's port",
    )
    timeout_s: PositiveFloat | None = Field(
        default=None, description="per export call; null = OTEL_EXPORTER_OTLP_TIMEOUT, else 10"
    )
    max_queue_spans: PositiveInt = Field(
        default=2048,
        description="spans waiting for the exporter; beyond, spans are dropped and counted "
        "(sluice_trace_dropped_total), never waited for",
    )


class Tracing(_Model):
    """OpenTelemetry traces with tail sampling decided in the process when a request ends.

    Errors, refusals and slow requests are always kept; of the rest, `sample_ratio` of the
    traces, chosen by trace id (the same in every replica). Spans are built only for kept
    traces, from timings the request recorded, so a dropped request costs a few µs."""

    enabled: bool = Field(default=False, description="trace requests (needs `trace` in filters)")
    sample_ratio: float = Field(
        default=1.0e-5,
        ge=0.0,
        le=1.0,
        description="share of the traces that are neither errors nor slow that are kept "
        "(1e-5 = 0.001 %); also the sampled flag of the traceparent sent to backends",
    )
    slow_ms: PositiveFloat = Field(default=2000.0, description="slower than this is always kept")
    error_status: int = Field(
        default=400,
        ge=100,
        le=600,
        description="HTTP statuses at or above this are errors (always kept); gRPC: not OK",
    )
    service_name: str = Field(
        default="sluice", min_length=1, max_length=128, description="resource service.name"
    )
    max_pending_traces: PositiveInt = Field(
        default=1000,
        le=1_000_000,
        description="kept traces held for export; when full the oldest is dropped and counted",
    )
    max_spans_per_trace: PositiveInt = Field(
        default=64, le=10_000, description="spans held per trace; beyond, dropped and counted"
    )
    max_wait_ms: PositiveFloat = Field(
        default=1000.0,
        le=60_000,
        description="a kept trace waits this long for later requests of the same trace "
        "before it is exported",
    )
    genai_attributes: bool = Field(
        default=False,
        description="parse request and response bodies for the GenAI attributes (model, "
        "max_tokens, token usage) even when no other filter reads them (about one JSON parse "
        "per request and per stream event); without it they appear when another filter (token "
        "limits) has the bodies parsed",
    )
    exporter: TracingExporter = Field(
        default_factory=TracingExporter, description="OTLP exporter (defaults from OTEL_*)"
    )


FilterName = Literal["request_id", "trace", "access_log", "auth", "route"]
DEFAULT_FILTERS: tuple[FilterName, ...] = ("request_id", "trace", "access_log", "auth", "route")


class Guard(_Model):
    """The change guard: a reload that would break most recent traffic is held, not applied."""

    enabled: bool = Field(
        default=True,
        description="compare each new policy with the recent traffic before it goes live",
    )
    max_affected_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="hold a change that would refuse at least this share of the recent requests "
        "(no route, no usable endpoint, a body limit or timeout they exceed)",
        examples=[0.5, 0.2],
    )
    min_requests: PositiveInt = Field(
        default=20,
        description="below this many requests in the window (~5 min) the guard has nothing to "
        "judge and lets the change through",
    )


RolloutStage = Literal["shadow"] | Annotated[float, Field(gt=0, le=100)]


def _default_stages() -> list[RolloutStage]:
    return ["shadow", 5.0, 25.0, 100.0]


class Rollout(_Model):
    """Staged rollout of this policy when it replaces a running one (not at boot)."""

    stages: list[RolloutStage] = Field(
        default_factory=_default_stages,
        min_length=1,
        max_length=16,
        description="`shadow` (decisions computed and counted, no effect) then growing "
        "percentages of requests (by a hash of the request id) served by the new policy",
        examples=[["shadow", 5, 25, 100], [10, 100]],
    )
    hold_s: PositiveFloat = Field(
        default=60.0, description="how long each stage lasts before the next one"
    )
    min_requests: PositiveInt = Field(
        default=50,
        description="requests the new share must serve in a stage before it is judged; a stage "
        "never advances on less (promote it by hand)",
    )
    max_error_rate_increase: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="roll back when the new share's error rate (5xx, no route, gRPC UNAVAILABLE "
        "...) exceeds the old share's by more than this (absolute, 0.02 = 2 points)",
    )
    max_p95_ratio: float = Field(
        default=1.5, ge=1, description="roll back when new p95 > old p95 × this + p95_slack_s"
    )
    p95_slack_s: float = Field(
        default=0.05, ge=0, description="absolute slack added to the p95 allowance"
    )

    @field_validator("stages")
    @classmethod
    def _stage_order(cls, v: list[str | float]) -> list[str | float]:
        if "shadow" in v[1:]:
            raise ValueError("`shadow` can only be the first stage")
        pct = [float(s) for s in v if s != "shadow"]
        if not pct or pct[-1] != 100:
            raise ValueError("the last stage must be 100")
        if any(b <= a for a, b in zip(pct, pct[1:], strict=False)):
            raise ValueError("percentages must grow from stage to stage")
        return v


class Policy(_Model):
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
    errors += auth_reference_errors(p)
    hb, cap = p.datapath.max_header_block_bytes, p.limits.grpc_max_metadata_bytes
    if p.datapath.enabled and hb and hb < 2 * cap:  # HPACK output stays below the metadata size
        errors.append(
            (
                ("datapath", "max_header_block_bytes"),
                f"{hb} would drop clients whose metadata fits limits.grpc_max_metadata_bytes "
                f"({cap}): use at least {2 * cap}, or 0 to turn the check off",
            )
        )
    if p.tracing.enabled and "trace" not in p.filters:
        errors.append((("filters",), "tracing is enabled: list 'trace' in filters"))
    return errors


def _backend_errors(j: int, b: Backend) -> list[tuple[Loc, str]]:
    errors: list[tuple[Loc, str]] = []
    seen: set[str] = set()
    for k, e in enumerate(b.endpoints):
        if e.address in seen:
            errors.append((("backends", j, "endpoints", k, "address"), "duplicate address"))
        seen.add(e.address)
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
