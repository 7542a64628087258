"""(compiled) The per-request context shared by the engines, the forwarding path, the filters, the
policy runtime and telemetry: what one request carries from admission to its finish (typed
slots the filters fill, how it ended, upstream tries and stream timings), and the small
values that travel with it (the chain's `Status`, response `StreamEvent`s, the
`Principal`). A leaf: it imports only `gateway.core` (and the compiled policy's types for
checking)."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from gateway.core.body import RequestBody, Usage
from gateway.core.outcome import Outcome
from gateway.core.request import RequestInfo
from gateway.core.traceparent import client_span_id
from gateway.core.verdict import ALLOW, Verdict

if TYPE_CHECKING:
    from gateway.policy.compiled import CompiledPolicy, CompiledRoute, Endpoint

_monotonic: Final = time.monotonic  # a static: no module attribute lookup per call


class Status(enum.Enum):
    CONTINUE = enum.auto()
    STOP = enum.auto()  # ctx.verdict is set: answer now (or end the response cleanly)


class EventKind(enum.Enum):
    HEAD = "head"  # response status and headers are known (HTTP); initial metadata (gRPC)
    SSE = "sse"  # one server-sent event of a streaming response
    JSON = "json"  # the JSON body of a non-streaming response (parsed, up to a cap)
    TRAILERS = "trailers"  # gRPC trailing metadata


class StreamEvent:
    """One thing that came back, shown to on_event (read it; filters do not change it).

    A plain slotted class rather than a frozen dataclass (whose `__init__` sets each field
    through `object.__setattr__`: ~0.7 µs an event here); the head's headers are decoded only
    if a filter reads `metadata`."""

    __slots__ = ("kind", "status", "data", "doc", "_metadata", "_raw")

    def __init__(
        self,
        kind: EventKind,
        status: int = 0,
        data: bytes = b"",
        doc: Any = None,
        metadata: tuple[tuple[str, str], ...] = (),
        raw_headers: Sequence[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.kind = kind
        self.status = status  # HEAD: the upstream HTTP status / 0 for gRPC
        self.data = data  # SSE: the event's data
        self.doc = doc  # SSE / JSON: the parsed JSON (None if not JSON)
        self._metadata = metadata
        self._raw = raw_headers  # HEAD (HTTP): the upstream's header bytes, decoded on demand

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """HEAD: the response headers (lower-case names) / TRAILERS: the trailing metadata."""
        raw = self._raw
        if raw is not None:
            self._raw = None
            self._metadata = tuple(
                (n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in raw
            )
        return self._metadata

    def __repr__(self) -> str:
        return f"StreamEvent({self.kind}, status={self.status})"


class ClassOf(Protocol):
    """What names a request's priority class (`gateway.ratelimit.compiled.PriorityFn`)."""

    def of(self, headers: Mapping[str, str], claims: Mapping[str, Any] | None) -> int: ...


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling, as established by the auth filter."""

    provider: str  # the auth provider's name
    subject: str  # `sub` claim ("" if absent)
    claims: Mapping[str, Any]  # verified claims (never the token itself)


@dataclass(slots=True)
class Decision:
    """One filter decision, kept for the trace of the request (bounded per request)."""

    at: float  # monotonic clock
    filter: str
    name: str  # e.g. "auth.ok", "limit.reject", "route.pick"
    detail: str = ""  # short, safe to log


MAX_DECISIONS: Final = 32
# Upstream tries remembered per request for the trace (retries beyond: counted).
MAX_TRIES: Final = 8


class UpstreamTry:
    """One upstream try of a request (a retry is another), for its trace's client span.

    Recorded only while tracing is on (`ctx.trace_id` set): the forwarding path calls
    `ctx.begin_try` when it starts sending to an endpoint and `ctx.end_try` when that try is
    over (answered, failed, or abandoned). A plain class (compiled, built without a Python frame;
    a dataclass's generated `__init__` runs interpreted)."""

    __slots__ = ("backend", "address", "started", "ended", "first_byte_at", "status", "error")

    def __init__(self, backend: str, address: str, started: float) -> None:
        self.backend = backend
        self.address = address
        self.started = started  # monotonic clock
        self.ended = 0.0  # 0 until end_try
        self.first_byte_at: float | None = None  # response head received (ctx.try_first_byte)
        self.status = 0  # HTTP status / gRPC code the backend answered (0: none)
        self.error = ""  # why the try failed, an Outcome value ("" = it answered)


class RequestContext:
    """Mutable state of one request. `policy` is the snapshot the request started with: a reload
    in the middle of the request does not change what it sees.

    A plain class whose defaults are class attributes (all immutable): `__init__` sets only what
    differs per request, ~0.3 µs instead of the ~1.5 µs of a dataclass setting 40 fields."""

    info: RequestInfo
    policy: CompiledPolicy
    request_id: str = ""
    verdict: Verdict  # ALLOW until a filter stops the request (set in __init__)
    route: CompiledRoute | None = None
    endpoint: Endpoint | None = None
    started: float  # monotonic clock, at arrival
    started_wall: float  # time.time() at arrival
    # How it ended (set by the forwarding path; filters read it in on_response).
    outcome: Outcome  # OK until the forwarding path says otherwise (set in __init__)
    detail: str = ""  # short safe text about the outcome, for the log (never a secret)
    http_status: int = 0
    grpc_status: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    first_byte_at: float | None = None  # monotonic time the first response byte went out
    ran: int = 0  # filters whose on_request ran (on_response unwinds those)
    attempts: int = 0  # upstream tries (retries included)
    # Headers/metadata filters add to the upstream request (lower-case names). The client's own
    # headers of these names are never forwarded; a value of "" sends none at all (how auth
    # removes a client-supplied copy of a claim header when the claim is absent).
    upstream_headers: dict[str, str]
    # Headers filters add to the client response (HTTP) / trailing metadata (gRPC).
    response_headers: list[tuple[str, str]]
    # Typed slots the filters fill.
    principal: Principal | None = None  # auth
    priority: int | None = None  # 0 = highest: the effective class (limits, shedding, queue)
    admission: Any = None  # the admission queue's hold on a slot, given back in on_response
    queue_wait: float | None = None  # seconds waited in the admission queue (None: no queue)
    reservation: Any = None  # the limiter's token reservation, reconciled in on_response
    budget: Any = None  # the budget filter's reservations, settled in on_response
    budget_warning: str = ""  # budgets past a warn_at fraction (header and access log)
    body: RequestBody | None = None  # the body phase's view of the request body
    usage: Usage | None = None  # what the backend reported (JSON usage, final SSE chunk, trailer)
    # A filter whose on_event runs only when asked (`events_when_asked`) asked for this request's
    # response phase: the answer is parsed and shown to on_event (see `Chain.listens`).
    wants_events: bool = False
    trace_id: int = 0  # 128-bit W3C trace id (0 = none yet)
    parent_span_id: int = 0  # the client's span, from an incoming traceparent
    trace_flags: int = 0
    decisions: list[Decision] | None = None  # filled only when something is recorded
    upstream_attempt: Any = None  # routing: the member of this try (gateway.registry.member)
    # Tracing (filled while the trace filter runs; all cheap scalars until a trace is kept).
    span_id: int = 0  # the gateway's server span for this request
    tries: list[UpstreamTry] | None = None  # upstream tries (begin_try / end_try)
    trace_kept: bool = False  # the tail sampler kept this request's trace (exemplars)
    # Streams: the forwarding path calls `stream_event(now)` for each SSE event (or gRPC
    # response message) that carries output, for time to first token and inter-token latency.
    first_token_at: float | None = None
    last_token_at: float | None = None
    stream_events: int = 0
    # Time spent waiting for upstream heads (every try), and what Sluice itself took until the
    # answer's head: `x-sluice-overhead-ms` (set when the head is made).
    upstream_s: float = 0.0
    overhead_s: float | None = None
    ended: float = 0.0  # monotonic clock, when the request ended (0: not yet)

    def __init__(self, info: RequestInfo, policy: CompiledPolicy) -> None:
        self.info = info
        self.policy = policy
        self.started = _monotonic()
        self.started_wall = time.time()
        self.upstream_headers = {}
        self.response_headers = []
        self.verdict = ALLOW  # (not class defaults: mypyc sets only literal ones)
        self.outcome = Outcome.OK

    def __repr__(self) -> str:
        return f"RequestContext({self.info.method} {self.info.path[:80]!r}, id={self.request_id})"

    @property
    def claims(self) -> Mapping[str, Any] | None:
        """The verified claims of the caller (None: not authenticated)."""
        p = self.principal
        return p.claims if p is not None else None

    def effective_class(self, pf: ClassOf | None, claims: Mapping[str, Any] | None) -> int:
        """The request's priority class (0 = highest), decided once, by the first filter that
        needs it (limits, the admission queue): both read the same compiled `pf`."""
        prio = self.priority
        if prio is None:
            prio = self.priority = pf.of(self.info.headers, claims) if pf is not None else 0
        return prio

    def stop(self, verdict: Verdict) -> Status:
        self.verdict = verdict
        return Status.STOP

    def decide(self, filter_name: str, name: str, detail: str = "") -> None:
        """Record a decision for the trace (cheap; bounded to MAX_DECISIONS per request)."""
        d = self.decisions
        if d is None:
            d = self.decisions = []
        if len(d) < MAX_DECISIONS:
            d.append(Decision(_monotonic(), filter_name, name, detail))

    def begin_try(self, backend: str, address: str, now: float) -> None:
        """An upstream try starts (call it before each try, retries too). Counts `attempts`;
        while tracing is on, remembers the try and points the `traceparent` sent upstream at
        this try's client span."""
        n = self.attempts
        self.attempts = n + 1
        if not self.trace_id:
            return
        tries = self.tries
        if tries is None:
            tries = self.tries = []
        if len(tries) < MAX_TRIES:
            tries.append(UpstreamTry(backend, address, now))
        if n:  # the first try's traceparent was set by the trace filter
            tp = self.upstream_headers.get("traceparent")
            if tp is not None:
                span = client_span_id(self.span_id, n)
                self.upstream_headers["traceparent"] = f"{tp[:36]}{span:016x}{tp[52:]}"

    def try_first_byte(self, now: float, status: int = 0) -> None:
        """The current try's response head (HTTP status) / initial metadata (gRPC) arrived."""
        if self.tries and self.attempts <= MAX_TRIES:
            t = self.tries[-1]
            t.first_byte_at = now
            if status:
                t.status = status

    def end_try(self, now: float, status: int = 0, error: str = "") -> None:
        """The current try is over (first call wins): `status` the backend's HTTP status /
        gRPC code if not given before, `error` an `Outcome` value when the try failed."""
        if self.tries and self.attempts <= MAX_TRIES:
            t = self.tries[-1]
            if not t.ended:
                t.ended, t.error = now, error
                if status:
                    t.status = status

    def stream_event(self, now: float) -> None:
        """An output event of a streaming response went to the client (SSE event with data,
        gRPC response message)."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.stream_events += 1

    @property
    def error(self) -> str:
        """The outcome's label, "" when OK; a rejection's own type when Sluice refused."""
        if self.outcome is Outcome.OK:
            return ""
        if self.outcome is Outcome.REJECTED and self.verdict.error_type:
            return self.verdict.error_type
        value: str = self.outcome.value
        return value

    @property
    def cancelled(self) -> bool:
        return self.outcome is Outcome.CLIENT_CANCELLED

    @property
    def elapsed(self) -> float:
        """Seconds from arrival to the end (to now while it runs)."""
        return (self.ended or _monotonic()) - self.started
