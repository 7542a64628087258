"""Test peers for tracing: a real OTLP/gRPC trace receiver (the TraceService of the
`opentelemetry-proto` package, served by grpcio) and a tiny backend that records the headers
(HTTP) and metadata (gRPC) Sluice sends upstream, answering with fixed bodies (it never echoes
what it received)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.support import free_port


@dataclass
class Span:
    trace_id: int
    span_id: int
    parent_span_id: int
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[str]
    status_code: int
    service: str


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span; `spans_of(trace_id)` waits for them."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the proto's name
        got: list[Span] = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            int.from_bytes(s.trace_id, "big"),
                            int.from_bytes(s.span_id, "big"),
                            int.from_bytes(s.parent_span_id, "big") if s.parent_span_id else 0,
                            s.name,
                            s.kind,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                            [e.name for e in s.events],
                            s.status.code,
                            str(resource.get("service.name")),
                        )
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def traces(self) -> dict[int, list[Span]]:
        out: dict[int, list[Span]] = {}
        for s in self.snapshot():
            out.setdefault(s.trace_id, []).append(s)
        return out

    def wait_for(
        self, cond: Callable[[dict[int, list[Span]]], bool], timeout: float = 30.0
    ) -> dict[int, list[Span]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.traces()
            if cond(t):
                return t
            time.sleep(0.05)
        return self.traces()

    def __enter__(self) -> Receiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


SERVER = trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SpanKind.SPAN_KIND_CLIENT
STATUS_ERROR = trace_pb2.Status.StatusCode.STATUS_CODE_ERROR


@dataclass
class Capture:
    """Headers (HTTP) and metadata (gRPC) as the backend received them, newest last."""

    http: list[dict[str, str]] = field(default_factory=list)
    grpc: list[dict[str, str]] = field(default_factory=list)
    status: int = 200  # what the HTTP backend answers
    delay_s: float = 0.0


COMPLETION = {
    "id": "cmpl-1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
}


def _handler(cap: Capture) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        wbufsize = 65536  # head and body in one write (no delayed-ACK stall)
        disable_nagle_algorithm = True

        def log_message(self, *args: object) -> None:
            pass

        def _answer(self) -> None:
            n = int(self.headers.get("content-length") or 0)
            if n:
                self.rfile.read(n)
            cap.http.append({k.lower(): v for k, v in self.headers.items()})
            if cap.delay_s:
                time.sleep(cap.delay_s)
            body = json.dumps(COMPLETION).encode()
            self.send_response(cap.status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = _answer  # noqa: N815
        do_POST = _answer  # noqa: N815

    return H


class _Generic(grpc.GenericRpcHandler):
    def __init__(self, cap: Capture) -> None:
        self.cap = cap

    def service(self, details: Any) -> Any:
        fail = details.method.endswith("/Fail")

        def unary(request: bytes, context: Any) -> bytes:
            self.cap.grpc.append({k: v for k, v in context.invocation_metadata()})
            if fail:
                context.abort(grpc.StatusCode.UNAVAILABLE, "backend says no")
            return b""

        return grpc.unary_unary_rpc_method_handler(unary)


@dataclass
class CaptureBackend:
    cap: Capture
    http_port: int
    grpc_port: int


def capture_backend() -> Iterator[CaptureBackend]:
    cap = Capture()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(cap))
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    gport = free_port()
    gsrv = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[_Generic(cap)])
    gsrv.add_insecure_port(f"127.0.0.1:{gport}")
    gsrv.start()
    try:
        yield CaptureBackend(cap, int(httpd.server_address[1]), gport)
    finally:
        gsrv.stop(0)
        httpd.shutdown()
        httpd.server_close()


class HttpReceiver(Receiver):
    """The same collector over OTLP/HTTP (protobuf bodies POSTed to /v1/traces)."""

    def __init__(self) -> None:
        self.spans = []
        self.requests = 0
        self._lock = threading.Lock()
        rx = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                ok = self.path == "/v1/traces" and "protobuf" in self.headers.get(
                    "content-type", ""
                )
                if ok:
                    req = trace_service_pb2.ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    rx.Export(req, None)
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])

    def __enter__(self) -> HttpReceiver:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
