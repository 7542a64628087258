"""Policy model primitives and the ingress sections: the base model, host:port and Redis URL
types, listeners, limits, timeouts. Nothing here does I/O."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

Loc = tuple[str | int, ...]

HostPort = Annotated[
    str,
    Field(
        pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):[0-9]{1,5}$",
        description="host:port; IPv6 in brackets",
    ),
]

# A request path Sluice sends itself (health check, model listing): printable ASCII, bounded.
UrlPath = Annotated[str, Field(pattern=r"^/[\x21-\x7e]*$", max_length=1024)]


def is_loopback(host: str) -> bool:
    """True for `localhost` or a loopback address (IPv6 with or without brackets)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class PolicyModel(BaseModel):
    """The base of every model in the policy document: unknown fields are errors, values are
    frozen."""

    # inf/nan would pass PositiveFloat (`.inf` is valid YAML) and disable a timeout by accident.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def fill_unset(model: BaseModel, **values: object) -> None:
    """Give each named field the value derived from its siblings, unless the user wrote it.

    A default must never conflict with a valid value of another field: a field whose
    documented default depends on another one is filled here, after validation (the model
    is frozen, and `model_fields_set` keeps saying the user did not write it)."""
    for name, value in values.items():
        if name not in model.model_fields_set:
            object.__setattr__(model, name, value)


def fill_ordered(model: BaseModel, names: tuple[str, ...]) -> None:
    """Fields that must not decrease in the order of `names`: each one the user left unset
    takes its default clamped between the values written before and after it, so that
    writing one field alone never makes the defaults of the others invalid."""
    written = model.model_fields_set
    values: dict[str, object] = {}
    for i, name in enumerate(names):
        if name in written:
            continue
        lower = [getattr(model, n) for n in names[:i] if n in written]
        upper = [getattr(model, n) for n in names[i + 1 :] if n in written]
        value = getattr(model, name)
        if lower:
            value = max(value, *lower)
        if upper:
            value = min(value, *upper)
        values[name] = value
    fill_unset(model, **values)


class ListenerTls(PolicyModel):
    """TLS termination on a listener. The files are read at start and watched: a change is
    picked up within ~2 s for new connections (open ones keep theirs); a change that does not
    load keeps the old certificate serving."""

    cert: str = Field(
        min_length=1,
        description="PEM file: the server certificate, then its intermediates (the chain)",
        examples=["/etc/sluice/tls/tls.crt"],
    )
    key: str = Field(
        min_length=1,
        description="PEM file: the private key of `cert` (unencrypted)",
        examples=["/etc/sluice/tls/tls.key"],
    )
    client_ca: str | None = Field(
        default=None,
        description="PEM file of the CAs client certificates are verified against (mTLS); "
        "needed by client_cert optional or required",
        examples=["/etc/sluice/tls/ca.crt"],
    )
    client_cert: Literal["off", "optional", "required"] = Field(
        default="off",
        description="client certificates: off (not asked for), optional (verified when sent; "
        "a client without one gets in without identity), required (refused at the handshake "
        "without a valid one). A verified certificate's identity (first URI SAN, else first "
        "DNS SAN, else subject CN) is the rate-limit key part `client_cert` and the principal "
        "of a request without a JWT. The gRPC listener's grpcio engine offers off and required "
        "only (its h2 engine all three)",
    )

    @field_validator("client_cert", mode="before")
    @classmethod
    def _off(cls, v: object) -> object:
        # YAML 1.1 reads a bare `off` as false; the issue's own example writes it so.
        return "off" if v is False else v

    @model_validator(mode="after")
    def _client_ca(self) -> ListenerTls:
        if self.client_cert != "off" and self.client_ca is None:
            raise ValueError(f"client_cert: {self.client_cert} needs client_ca")
        return self


class Listener(PolicyModel):
    host: str = Field(default="0.0.0.0", description="address to bind")
    port: int = Field(ge=0, le=65535, description="port to bind; 0 picks a free one")
    engine: Literal["aiohttp", "native"] = Field(
        default="native",
        description="HTTP engine (http listener only): native (default), an asyncio.Protocol + "
        "httptools server, or aiohttp's server (~30 µs/request more CPU; the same behaviour, "
        "checked by a differential fuzz test, except for known aiohttp parser limits)",
    )
    tls: ListenerTls | None = Field(
        default=None, description="terminate TLS on this listener (null = plaintext)"
    )


class GrpcListenerConfig(PolicyModel):
    """The gRPC listener: a generic pass-through of any method (`listeners.grpc`)."""

    host: str = Field(default="0.0.0.0", description="address to bind")
    port: int = Field(ge=0, le=65535, description="port to bind; 0 picks a free one")
    engine: Literal["grpcio", "h2"] = Field(
        default="h2",
        description="gRPC engine: h2 (default), Sluice's own HTTP/2 engine (python-hyper h2 "
        "on asyncio), which applies limits.http2 to the gRPC port (CONTINUATION, PING, "
        "SETTINGS, empty-frame and rapid-reset floods, stream concurrency refused per stream), "
        "checks a message's size on its 5-byte prefix, and offers client_cert optional under "
        "TLS; or grpcio, grpc.aio's server (no flood bounds; client_cert off or required "
        "only). Read at start (a change needs a restart)",
    )
    tls: ListenerTls | None = Field(
        default=None, description="terminate TLS on this listener (null = plaintext; ALPN h2)"
    )


class Listeners(PolicyModel):
    http: Listener | None = Field(
        default_factory=lambda: Listener(port=8080), description="HTTP/1.1 ingress (null = off)"
    )
    grpc: GrpcListenerConfig | None = Field(
        default_factory=lambda: GrpcListenerConfig(port=8081),
        description="gRPC ingress (null = off)",
    )
    admin: Listener | None = Field(
        default_factory=lambda: Listener(host="127.0.0.1", port=9901),
        description="admin listener: /healthz /readyz /metrics /status /admin/policy",
    )


class Http2Limits(PolicyModel):
    """Bounds of the HTTP/2 engine (h2c with prior knowledge on the HTTP listener; h2 over TLS
    once ALPN offers it). Defaults are the trusted servers' (Envoy, nginx, nghttp2, h2). A flood
    past a bound ends the connection with GOAWAY ENHANCE_YOUR_CALM; the timeouts are
    `timeouts.header_read_s` (the first request's headers, and any header block left open) and
    `timeouts.keepalive_s` (a connection with no open stream). Read when the listener starts:
    a change needs a restart (`sluice policy diff` says so)."""

    max_concurrent_streams: PositiveInt = Field(
        default=100,
        description="SETTINGS_MAX_CONCURRENT_STREAMS; a stream past it is refused with "
        "RST_STREAM REFUSED_STREAM, the connection lives on (h2, Envoy: 100)",
    )
    initial_stream_window_bytes: int = Field(
        default=65535,
        ge=1024,
        le=2**31 - 1,
        description="SETTINGS_INITIAL_WINDOW_SIZE: request body bytes a stream may have unread; "
        "window is returned only as the request's consumer takes the bytes, and the connection "
        "window is this times max_concurrent_streams, so one slow stream never stalls others",
    )
    max_frame_bytes: int = Field(
        default=16384,
        ge=16384,
        le=2**24 - 1,
        description="SETTINGS_MAX_FRAME_SIZE; a frame declaring more is refused from its 9-byte "
        "header, before its payload is buffered (GOAWAY FRAME_SIZE_ERROR)",
    )
    max_header_list_bytes: PositiveInt = Field(
        default=32768,
        description="SETTINGS_MAX_HEADER_LIST_SIZE, and the largest header block (HEADERS + "
        "CONTINUATION payloads, counted frame by frame as their headers arrive): one more "
        "byte ends the connection with GOAWAY ENHANCE_YOUR_CALM; limits.max_header_bytes "
        "still answers 431 below it (default max(32768, twice limits.max_header_bytes and "
        "twice limits.grpc_max_metadata_bytes))",
    )
    max_continuation_frames: PositiveInt = Field(
        default=8, description="CONTINUATION frames in one header block (nghttp2: 8)"
    )
    max_pings_per_s: PositiveInt = Field(
        default=100, description="PING frames from the client per second"
    )
    max_settings_per_s: PositiveInt = Field(
        default=10, description="SETTINGS frames (not ACKs) from the client per second"
    )
    max_consecutive_empty_frames: int = Field(
        default=1,
        ge=0,
        description="DATA frames in a row with no payload and no END_STREAM (Envoy: 1)",
    )
    max_priority_frames_per_stream: PositiveInt = Field(
        default=100, description="PRIORITY frames per stream opened, plus one stream (Envoy)"
    )
    max_window_updates_per_data_frame: PositiveInt = Field(
        default=10,
        description="WINDOW_UPDATE frames allowed: 5 + 2 × (streams + this × DATA frames sent) "
        "(Envoy)",
    )
    rapid_reset_min_streams: PositiveInt = Field(
        default=500,
        description="streams a connection opens before its early-reset ratio is judged (Envoy)",
    )
    rapid_reset_ratio: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="share of streams reset by the client before their answer ended and "
        "within 1 s of their start (or refused past max_concurrent_streams beyond an "
        "allowance of twice max_concurrent_streams, refilled at max_concurrent_streams per "
        "second), past which the connection gets GOAWAY ENHANCE_YOUR_CALM (Envoy: 0.5)",
    )
    max_new_streams_per_read: PositiveInt = Field(
        default=200, description="new streams in one read from the socket (nginx: 2 × streams)"
    )
    max_requests_per_connection: PositiveInt = Field(
        default=1000,
        description="streams per connection; then a graceful GOAWAY (nginx, hypercorn: 1000)",
    )
    max_queued_control_frames: PositiveInt = Field(
        default=1000,
        description="control frames (PING/SETTINGS ACKs, RST_STREAM, WINDOW_UPDATE) written "
        "while the client does not read (reading stops meanwhile); past it, or when the socket "
        "buffer fills with no stream open, the connection is closed (Envoy: 1000)",
    )
    drain_goaway_delay_s: PositiveFloat = Field(
        default=1.0,
        description="at drain, a GOAWAY announcing stream 2^31-1 first, then after this delay "
        "the one with the last stream taken; open streams finish within timeouts.drain_s",
    )


class Limits(PolicyModel):
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
    grpc_first_data_wait_s: float = Field(
        default=1.0,
        ge=0.0,
        le=60.0,
        description="HTTP/2 engine: a streaming gRPC call is handed to the chain and opens its "
        "upstream call at its first DATA bytes or half-close, or after this long without "
        "either (a call held open with no message costs nothing upstream; a method whose "
        "server speaks first is delayed this long); 0 opens it at HEADERS",
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
    http2: Http2Limits = Field(
        default_factory=Http2Limits, description="bounds of the HTTP/2 engine (h2c, h2)"
    )


class Timeouts(PolicyModel):
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
    tls_handshake_s: PositiveFloat = Field(
        default=10.0,
        description="a client must finish the TLS handshake within this, or the connection is "
        "closed (TLS listeners only)",
    )
    body_read_s: PositiveFloat = Field(
        default=30.0,
        description="a buffered request body (see limits.max_buffered_body_bytes) must arrive "
        "within this (408)",
    )


RedisUrl = Annotated[
    str,
    Field(
        pattern=r"^(redis|rediss|unix)://\S+$",
        max_length=1024,
        description="redis://[user:password@]host:port/db, rediss:// for TLS, or unix://path",
    ),
]
