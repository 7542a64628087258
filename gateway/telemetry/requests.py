"""(compiled) Recording one finished request: the request, latency, overhead and LLM metrics through
tallies (`gateway.telemetry.tally`), once per request from `gateway.forward.lifecycle`.

The metrics themselves are defined in `gateway.telemetry.metrics`; this module owns the caches
of their tallies by label values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, TypeVar

from prometheus_client import Counter, Histogram

from gateway.core.outcome import Outcome
from gateway.core.request import Wire
from gateway.core.verdict import ALLOW
from gateway.telemetry import metrics as m
from gateway.telemetry.tally import CountTally, HistTally

if TYPE_CHECKING:
    from gateway.context import RequestContext

# Per-request updates go through tallies (`gateway.telemetry.tally`: plain numbers, added to the
# children before each scrape), cached by their label values: `.labels()` costs a lock and a
# tuple per call. Keys come from policy names and small closed sets (codes), so the caches stay
# small; they are bounded anyway, and a full cache only means the slow path.
_MAX_CACHED: Final = 4096
_tallies: Final[dict[tuple[Any, ...], Any]] = {}
_T = TypeVar("_T", CountTally, HistTally)


def counter_tally(metric: Counter, *labels: str) -> CountTally:
    """The tally of `metric`'s child for `labels` (cached)."""
    t = _tallies.get((metric, *labels))
    return t if t is not None else _new_tally(CountTally(metric.labels(*labels)), metric, labels)


def hist_tally(metric: Histogram, *labels: str) -> HistTally:
    """The tally of `metric`'s child for `labels` (cached)."""
    t = _tallies.get((metric, *labels))
    return t if t is not None else _new_tally(HistTally(metric.labels(*labels)), metric, labels)


def _new_tally(t: _T, metric: object, labels: tuple[str, ...]) -> _T:
    if len(_tallies) < _MAX_CACHED:
        _tallies[(metric, *labels)] = t
    return t


class _Finished:
    """The tallies one kind of finished request updates (route, backend, code, protocol)."""

    __slots__ = ("requests", "seconds", "overhead", "labels", "tokens")

    def __init__(self, route: str, backend: str, code: str, protocol: str) -> None:
        self.labels = (route, backend, code, protocol)
        self.requests = counter_tally(m.REQUESTS, route, backend, code, protocol)
        self.seconds = hist_tally(m.REQUEST_SECONDS, route, protocol)
        self.overhead = hist_tally(m.OVERHEAD_SECONDS, route, protocol)
        # The usage tokens' tallies (input, output), looked up at the first answer with usage.
        self.tokens: tuple[CountTally, CountTally] | None = None


_finished: Final[dict[tuple[object, ...], _Finished]] = {}


def record_request(ctx: RequestContext) -> None:
    """Count one finished request. Called once per request by
    `gateway.forward.lifecycle.Lifecycle.finish`."""
    route_, endpoint = ctx.route, ctx.endpoint
    route = route_.name if route_ is not None else "none"
    backend = endpoint.backend if endpoint is not None else "none"
    protocol = ctx.info.protocol
    grpc = protocol is Wire.GRPC
    status = ctx.grpc_status if grpc else ctx.http_status
    key = (route, backend, status, grpc)  # not the enum: its hash is a Python-level call
    fin = _finished.get(key)
    if fin is None:
        code = str(status if status is not None else 2) if grpc else str(status or 0)
        fin = _Finished(route, backend, code, protocol.value)
        if len(_finished) < _MAX_CACHED:
            _finished[key] = fin
    # Exemplars (OpenMetrics exposition) point at the traces the tail sampler kept.
    exemplar = {"trace_id": f"{ctx.trace_id:032x}"} if ctx.trace_kept else None
    if exemplar is None:
        fin.requests.inc()
    else:
        m.REQUESTS.labels(*fin.labels).inc(1, exemplar)
    fin.seconds.observe(ctx.elapsed, exemplar)
    if ctx.overhead_s is not None:
        fin.overhead.observe(ctx.overhead_s)
    if ctx.first_token_at is not None or ctx.usage is not None:
        _record_llm(ctx, fin, route, backend, exemplar)
    # (properties are Python calls: read them only off the common path)
    if ctx.outcome is Outcome.CLIENT_CANCELLED:
        m.CLIENT_CANCELLED.labels(protocol.value).inc()
    verdict = ctx.verdict
    if verdict is not ALLOW and not verdict.allowed:
        m.REJECTED.labels(verdict.error_type or "rejected", protocol.value).inc()


def _record_llm(
    ctx: RequestContext,
    fin: _Finished,
    route: str,
    backend: str,
    exemplar: dict[str, str] | None,
) -> None:
    """Streams: time to first token, mean inter-token latency; any answer: usage tokens."""
    usage = ctx.usage
    first = ctx.first_token_at
    if first is not None:
        hist_tally(m.TIME_TO_FIRST_TOKEN, route, backend).observe(first - ctx.started, exemplar)
        last = ctx.last_token_at
        tokens = usage.completion_tokens if usage is not None else ctx.stream_events
        if last is not None and tokens > 1 and last > first:
            hist_tally(m.INTER_TOKEN_LATENCY, route, backend).observe((last - first) / (tokens - 1))
    if usage is not None:
        tallies = fin.tokens
        if tallies is None:
            tallies = fin.tokens = (
                counter_tally(m.TOKENS, route, backend, "input"),
                counter_tally(m.TOKENS, route, backend, "output"),
            )
        tallies[0].inc(usage.prompt_tokens)
        tallies[1].inc(usage.completion_tokens)
