"""The tracing owner (`services.get(TRACING, ...)`): kept traces → SDK spans → OTLP.

Nothing here runs per request but `offer`, and only for the requests the tail sampler keeps:
it puts a compact record into the bounded pending buffer (`gateway.core.pending.PendingTraces`).
A background task (started at the first offer) takes the traces that have waited `max_wait`
(time for a later request of the same trace to join), builds their SDK spans with their real
times (`gateway.telemetry.spans.emit`) and ends them into a `BatchSpanProcessor`, whose own
thread exports them over OTLP (gRPC or HTTP). The exporter never blocks a request: spans are
handed over only while the processor's queue has room (counted against what the exporter has
finished), the rest are dropped and counted (`sluice_trace_dropped_total`).

Reload: `configure(section)` runs when a policy with tracing goes live. The pending buffer is
kept (re-bounded; the oldest traces beyond a smaller bound are dropped and counted); the export
pipeline is kept when the service name and exporter settings are unchanged, and replaced
otherwise (the old one is flushed and shut down in a worker thread). A policy without tracing
leaves the owner idle: what is pending is still exported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from gateway.core.pending import PendingTraces
from gateway.services import ServiceKey
from gateway.telemetry import metrics
from gateway.telemetry.spans import PresetIds, TraceRecord, emit

if TYPE_CHECKING:
    from gateway.policy.model import Tracing as TracingSection
    from gateway.policy.model import TracingExporter
    from gateway.services import Services

log = logging.getLogger("sluice.tracing")

SHUTDOWN_WAIT_S = 2.0  # at stop: longest wait for the last export (a dead collector)
PROTOCOLS = ("grpc", "http/protobuf")
EMIT_SLICE = 64  # traces built per slice before the export task yields to requests


def resolve_protocol(cfg: TracingExporter) -> str:
    """The policy's protocol, else the standard environment variables, else http/protobuf."""
    value = (
        cfg.protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if value not in PROTOCOLS:
        log.warning("OTLP protocol %r is not supported, using http/protobuf", value)
        return "http/protobuf"
    return value


class _CountingExporter:
    """Wraps the OTLP exporter: counts what it finished (the processor's queue is what was
    handed over minus that) and what it failed to deliver. Runs in the processor's thread."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.done = 0

    def export(self, batch: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        n = len(batch)
        try:
            result = self.inner.export(batch)
        except Exception:  # an exporter bug must not kill the processor's thread
            log.exception("span export failed")
            result = SpanExportResult.FAILURE
        self.done += n
        ok = result is SpanExportResult.SUCCESS
        metrics.TRACE_SPANS_EXPORTED.labels("ok" if ok else "failed").inc(n)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flush = getattr(self.inner, "force_flush", None)
        return bool(flush(timeout_millis)) if flush is not None else True


class Pipeline:
    """One SDK tracer over a batch processor and an OTLP exporter, for one exporter config."""

    def __init__(self, service_name: str, cfg: TracingExporter) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        self.key = (service_name, cfg)
        self.protocol = resolve_protocol(cfg)
        self.max_queue = cfg.max_queue_spans
        kwargs: dict[str, Any] = {}
        if cfg.endpoint:
            kwargs["endpoint"] = cfg.endpoint
        if cfg.timeout_s:
            kwargs["timeout"] = cfg.timeout_s
        if self.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        self.exporter = _CountingExporter(OTLPSpanExporter(**kwargs))
        self.processor = BatchSpanProcessor(
            self.exporter,  # type: ignore[arg-type]
            max_queue_size=cfg.max_queue_spans,
            max_export_batch_size=min(512, cfg.max_queue_spans),
            # The SDK's 5 s default would add to max_wait; OTEL_BSP_SCHEDULE_DELAY still wins.
            schedule_delay_millis=float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", 500)),
        )
        self.ids = PresetIds()
        self.provider = TracerProvider(
            sampler=ALWAYS_ON,
            resource=Resource.create({"service.name": service_name}),
            id_generator=self.ids,
            shutdown_on_exit=False,
        )
        self.provider.add_span_processor(self.processor)
        from gateway import __version__

        self.tracer = self.provider.get_tracer("sluice", __version__)
        self.handed = 0

    @property
    def queued(self) -> int:
        """Spans handed to the processor that the exporter has not finished yet."""
        return self.handed - self.exporter.done

    def emit(self, record: TraceRecord) -> bool:
        """Build the record's spans if the queue has room for all of them (else False)."""
        if self.queued + record.spans > self.max_queue:
            return False
        self.handed += emit(self.tracer, self.ids, record)
        return True

    def shutdown(self) -> None:
        """Blocking: flush what is queued (bounded by the exporter's timeout), then stop."""
        self.provider.shutdown()


class Tracing:
    """The one tracing owner of the process (see the module docstring)."""

    def __init__(self, services: Services) -> None:
        self._services = services
        self.pending: PendingTraces[TraceRecord] = PendingTraces(1000, 64, 1.0)
        self.pipeline: Pipeline | None = None
        self._task: asyncio.Task[None] | None = None
        self._old: list[Pipeline] = []
        self._seen_dropped = (0, 0)

    def configure(self, section: TracingSection) -> None:
        """A policy with tracing went live: re-bound the buffer, (re)build the pipeline."""
        self.pending.resize(
            section.max_pending_traces, section.max_spans_per_trace, section.max_wait_ms / 1000
        )
        key = (section.service_name, section.exporter)
        if self.pipeline is None or self.pipeline.key != key:
            try:
                new = Pipeline(section.service_name, section.exporter)
            except Exception:  # the policy is live anyway: keep exporting as before
                log.exception("tracing: the OTLP exporter could not be set up")
                return
            old, self.pipeline = self.pipeline, new
            log.info(
                "tracing: exporting kept traces over OTLP %s (service %s)",
                self.pipeline.protocol,
                section.service_name,
            )
            if old is not None:
                self._flush(time.monotonic(), old, everything=True)
                self._old.append(old)
                self._spawn_shutdown(old)
        self._count_drops()

    def offer(self, record: TraceRecord, now: float) -> None:
        """A kept request (request path; cheap): hold it for export."""
        self.pending.offer(record.trace_id, record, record.spans, now)
        if self._task is None and not self._services.closed:
            self._task = self._services.spawn(self._run(), "tracing-export")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(0.02, min(0.25, self.pending.max_wait / 4)))
            pipeline = self.pipeline
            if pipeline is None:
                continue
            traces = self.pending.due(time.monotonic())
            for i in range(0, len(traces), EMIT_SLICE):  # let requests run between slices
                self._emit(traces[i : i + EMIT_SLICE], pipeline)
                await asyncio.sleep(0)
            self._count_drops()

    def _flush(self, now: float, pipeline: Pipeline, everything: bool = False) -> None:
        self._emit(self.pending.drain() if everything else self.pending.due(now), pipeline)
        self._count_drops()

    def _emit(self, traces: list[tuple[int, list[TraceRecord]]], pipeline: Pipeline) -> None:
        full = failed = 0
        for _, records in traces:
            for r in records:
                try:
                    if not pipeline.emit(r):
                        full += r.spans
                except Exception:  # a bad record must not stop the export of the others
                    log.exception("building the spans of a trace failed")
                    failed += r.spans
        if full:
            metrics.TRACE_DROPPED.labels("export_queue_full").inc(full)
        if failed:
            metrics.TRACE_DROPPED.labels("build_failed").inc(failed)

    def _count_drops(self) -> None:
        p = self.pending
        traces, spans = self._seen_dropped
        if p.dropped_traces != traces:
            metrics.TRACE_DROPPED.labels("pending_full").inc(p.dropped_traces - traces)
        if p.dropped_spans != spans:
            metrics.TRACE_DROPPED.labels("spans_per_trace").inc(p.dropped_spans - spans)
        self._seen_dropped = (p.dropped_traces, p.dropped_spans)
        metrics.TRACE_PENDING.set(len(p))

    def _spawn_shutdown(self, old: Pipeline) -> None:
        def stop() -> None:
            try:
                old.shutdown()
            finally:
                if old in self._old:
                    self._old.remove(old)

        _daemon(stop)

    def state(self) -> dict[str, Any]:
        p, pipe = self.pending, self.pipeline
        return {
            "pending_traces": len(p),
            "pending_spans": p.spans,
            "dropped_traces": p.dropped_traces,
            "dropped_spans": p.dropped_spans,
            "protocol": pipe.protocol if pipe is not None else None,
            "export_queue": pipe.queued if pipe is not None else 0,
        }

    async def aclose(self) -> None:
        """At stop: export what is pending, waiting at most SHUTDOWN_WAIT_S for a collector."""
        pipeline = self.pipeline
        if pipeline is None:
            return
        self._flush(time.monotonic(), pipeline, everything=True)
        if not await _wait(_daemon(pipeline.shutdown), SHUTDOWN_WAIT_S):
            log.warning("tracing: the collector did not take the last spans in time")


def _daemon(fn: Callable[[], None]) -> threading.Event:
    """Run a blocking shutdown in a daemon thread: a dead collector can make it last the
    exporter's timeout, and a daemon thread does not hold the process at exit."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception:
            log.exception("tracing: shutting the exporter down failed")
        finally:
            done.set()

    threading.Thread(target=run, name="sluice-trace-shutdown", daemon=True).start()
    return done


async def _wait(done: threading.Event, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done.is_set():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


TRACING: Final = ServiceKey[Tracing]("tracing")  # the tail sampler and exporter
