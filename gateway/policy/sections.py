"""Policy model: the feature sections that are not about routing (access log, simulated
backend, datapath, tracing, the change guard and staged rollout). Nothing here does I/O."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
)

from gateway.policy.base import HostPort, PolicyModel, is_loopback


class AccessLog(PolicyModel):
    enabled: bool = Field(default=True, description="one JSON line per request on stderr")
    headers: list[str] = Field(
        default_factory=list,
        description="extra request headers to log; authorization/cookie are never logged",
    )


class MockBackend(PolicyModel):
    """The built-in simulated inference server, started in-process (for `make run` and demos)."""

    enabled: bool = Field(
        default=False, description="start the simulated backend inside the gateway"
    )
    http: HostPort | None = Field(default="127.0.0.1:18000", description="its HTTP listener")
    grpc: HostPort | None = Field(default="127.0.0.1:18001", description="its gRPC listener")
    admin: HostPort | None = Field(
        default="127.0.0.1:0",
        description="its admin API (/admin/knobs, /admin/stats, /admin/reset), on a listener of "
        "its own, loopback only: never route to it (null = off); port 0 (the default) picks a "
        "free one, logged at start, so that two gateways on one host never collide",
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


class DatapathBudget(PolicyModel):
    """A token bucket: `rate` per second, up to `burst` at once; rate 0 means unlimited."""

    rate: int = Field(
        default=0, ge=0, le=4_000_000_000, description="tokens per second (0 = unlimited)"
    )
    burst: int = Field(
        default=0, ge=0, le=4_000_000_000, description="bucket size (0 = same as rate)"
    )


class Datapath(PolicyModel):
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
        "is dropped (CONTINUATION flood); at least twice limits.grpc_max_metadata_bytes "
        "(default max(65536, twice it)); 0 = off",
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


class TracingExporter(PolicyModel):
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


class Tracing(PolicyModel):
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


class Guard(PolicyModel):
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


class Rollout(PolicyModel):
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
