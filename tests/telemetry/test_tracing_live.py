"""A live gateway (`python -m gateway serve`) exporting to a real OTLP/gRPC receiver, in front of
a backend that records the headers and metadata it receives (it never echoes them)."""

from __future__ import annotations

import json
import random
import re
import socket
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gateway.core.sampler import threshold
from gateway.core.traceparent import MASK64, parse
from tests.integration.conftest import wait_ready
from tests.support import Proc, free_port, metric_total, wait_for_port, wait_until
from tests.telemetry.otlp import (
    CLIENT,
    SERVER,
    STATUS_ERROR,
    CaptureBackend,
    Receiver,
    Span,
    capture_backend,
)

pytestmark = pytest.mark.integration

RATIO = 0.25
SLOW_MS = 300
METHOD = "/test.Echo/Call"


@dataclass
class Live:
    proc: Proc
    http: int
    grpc: int
    admin: int
    backend: CaptureBackend
    rx: Receiver
    engine: str


def write_policy(path: Path, be: CaptureBackend, ports: tuple[int, int, int], tracing: str,
                 engine: str = "aiohttp", sim: int = 9, log: bool = False) -> None:  # fmt: skip
    http, grpc_, admin = ports
    path.write_text(f"""\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}, engine: {engine}}}
  grpc: {{host: 127.0.0.1, port: {grpc_}}}
  admin: {{host: 127.0.0.1, port: {admin}}}
timeouts: {{first_byte_s: 5, drain_s: 5}}
access_log: {{enabled: {"true" if log else "false"}}}
backends:
  - name: cap-http
    endpoints: [{{address: "127.0.0.1:{be.http_port}"}}]
  - name: cap-grpc
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{be.grpc_port}"}}]
    unary_methods: [{METHOD}, /test.Echo/Fail]
    discover_unary: false
  - name: sim
    endpoints: [{{address: "127.0.0.1:{sim}"}}]
    max_in_flight: 64
routes:
  - name: grpc
    match: {{protocol: grpc}}
    backend: cap-grpc
  - name: sim
    match: {{protocol: http, path_prefix: /sim/}}
    strip_prefix: /sim
    backend: sim
  - name: openai
    match: {{protocol: http, path_prefix: /v1/}}
    backend: cap-http
admission: {{}}
tracing:
{tracing}""")


def start(
    tmp: Path,
    be: CaptureBackend,
    rx: Receiver,
    tracing: str,
    engine: str,
    sim: int = 9,
    log: bool = False,
) -> Live:
    ports = (free_port(), free_port(), free_port())
    write_policy(tmp / "policy.yaml", be, ports, tracing, engine, sim, log)
    proc = Proc(["serve", "--policy", str(tmp / "policy.yaml")], tmp / "gateway.log")
    wait_ready(ports[2], proc)
    return Live(proc, *ports, be, rx, engine)


TRACING = f"""\
  enabled: true
  sample_ratio: {RATIO}
  slow_ms: {SLOW_MS}
  service_name: sluice-edge
  max_wait_ms: 50
  genai_attributes: true
"""


@pytest.fixture(scope="module")
def backend() -> Iterator[CaptureBackend]:
    yield from capture_backend()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The simulated inference backend (SSE streams with usage)."""
    port = free_port()
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    args = ["mock-backend", "--http", f"127.0.0.1:{port}", "--no-grpc", "--no-admin"]
    args += ["--ttft-ms", "30"]
    proc = Proc([*args, "--token-delay-ms", "5"], log)
    try:
        wait_for_port(port)
        yield port
    finally:
        proc.stop()


@pytest.fixture(scope="module", params=["aiohttp", "native"])
def live(
    request: pytest.FixtureRequest,
    backend: CaptureBackend,
    receiver: Receiver,
    sim: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Live]:
    tracing = TRACING + (
        f"  exporter: {{protocol: grpc, endpoint: 'http://127.0.0.1:{receiver.port}'}}\n"
    )
    gw = start(tmp_path_factory.mktemp("live"), backend, receiver, tracing, request.param, sim)
    try:
        yield gw
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


_rng = random.Random(11)
HIGH = threshold(RATIO) + 1  # a low-64-bit value never sampled by ratio


def new_trace(sampled: bool | None = None) -> int:
    """A random trace id; `sampled` forces which side of the ratio its low 64 bits fall."""
    t = _rng.getrandbits(128) | 1
    if sampled is True:
        t = (t >> 64 << 64) | _rng.randrange(1, threshold(RATIO))
    elif sampled is False:
        t = (t >> 64 << 64) | _rng.randrange(HIGH, MASK64)
    return t


PARENT = 0x1122334455667788


def tp(trace: int) -> str:
    return f"00-{trace:032x}-{PARENT:016x}-01"


def scrape(gw: Live) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.admin}/metrics", timeout=5) as r:
        return str(r.read().decode())


def post(gw: Live, path: str, trace: int | None = None, timeout: float = 10.0) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{gw.http}{path}", data=b'{"model": "m"}', method="POST"
    )
    req.add_header("content-type", "application/json")
    if trace is not None:
        req.add_header("traceparent", tp(trace))
        req.add_header("tracestate", "vendor=opaque")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        e.close()
        return int(e.code)


def grpc_call(gw: Live, trace: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc}") as ch:
        ch.unary_unary(METHOD)(b"", metadata=(("traceparent", tp(trace)),), timeout=10)


def wait_traces(
    rx: Receiver, traces: set[int], spans_each: int, timeout: float = 30.0
) -> dict[int, list[Span]]:
    got = rx.wait_for(
        lambda t: all(len(t.get(x, [])) >= spans_each for x in traces), timeout=timeout
    )
    missing = [x for x in traces if len(got.get(x, [])) < spans_each]
    assert not missing, f"{len(missing)} of {len(traces)} traces incomplete"
    return got


def test_traceparent_reaches_the_http_backend(live: Live) -> None:
    trace = new_trace()
    assert post(live, "/v1/chat/completions", trace) == 200
    seen = live.backend.cap.http[-1]
    parsed = parse(seen["traceparent"])
    assert parsed is not None
    assert parsed[0] == trace and parsed[1] != PARENT
    assert seen["tracestate"] == "vendor=opaque"
    assert post(live, "/v1/chat/completions") == 200  # no traceparent: a new trace
    fresh = parse(live.backend.cap.http[-1]["traceparent"])
    assert fresh is not None and fresh[0] != trace


def test_traceparent_reaches_the_grpc_backend(live: Live) -> None:
    sampled, unsampled = new_trace(True), new_trace(False)
    grpc_call(live, sampled)
    got = parse(live.backend.cap.grpc[-1]["traceparent"])
    assert got is not None and got[0] == sampled and got[1] != PARENT
    assert got[2] == 1  # the sampled flag follows the ratio, not the client's flag
    grpc_call(live, unsampled)
    got = parse(live.backend.cap.grpc[-1]["traceparent"])
    assert got is not None and got[0] == unsampled and got[2] == 0


def test_a_failed_grpc_call_arrives_complete(live: Live) -> None:
    t = new_trace(False)
    with (
        grpc.insecure_channel(f"127.0.0.1:{live.grpc}") as ch,
        pytest.raises(grpc.RpcError) as e,
    ):
        ch.unary_unary("/test.Echo/Fail")(b"", metadata=(("traceparent", tp(t)),), timeout=10)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    backend_tp = live.backend.cap.grpc[-1]["traceparent"]
    spans = wait_traces(live.rx, {t}, 2)[t]
    s = check_complete(spans, backend_tp)
    assert s.name == "test.Echo/Fail" and s.status_code == STATUS_ERROR
    assert s.attributes["rpc.system"] == "grpc" and s.attributes["rpc.service"] == "test.Echo"
    assert s.attributes["rpc.grpc.status_code"] == 14
    (c,) = [x for x in spans if x.kind == CLIENT]
    assert c.attributes["rpc.grpc.status_code"] == 14 and c.status_code == STATUS_ERROR


def check_complete(spans: list[Span], backend_tp: str | None) -> Span:
    server = [s for s in spans if s.kind == SERVER]
    assert len(server) == 1, spans
    s = server[0]
    assert s.parent_span_id == PARENT
    if backend_tp is not None:
        clients = [c for c in spans if c.kind == CLIENT]
        assert len(clients) == 1
        c = clients[0]
        assert c.parent_span_id == s.span_id
        parsed = parse(backend_tp)
        assert parsed is not None and parsed[1] == c.span_id  # the backend's parent: our try
        assert s.start_ns <= c.start_ns <= c.end_ns <= s.end_ns
    return s


def test_every_error_refusal_and_slow_trace_arrives_complete(live: Live) -> None:
    cap, rx = live.backend.cap, live.rx
    errors, refused, slow = set(), set(), set()
    tps: dict[int, str] = {}
    cap.status = 500
    try:
        for _ in range(20):
            t = new_trace(False)
            assert post(live, "/v1/chat/completions", t) == 500
            errors.add(t)
            tps[t] = cap.http[-1]["traceparent"]
    finally:
        cap.status = 200
    for _ in range(20):
        t = new_trace(False)
        assert post(live, "/nowhere", t) == 404  # no route: refused by Sluice
        refused.add(t)
    cap.delay_s = SLOW_MS / 1000 + 0.1
    try:
        for _ in range(3):
            t = new_trace(False)
            assert post(live, "/v1/chat/completions", t) == 200
            slow.add(t)
            tps[t] = cap.http[-1]["traceparent"]
    finally:
        cap.delay_s = 0.0
    got = wait_traces(rx, errors | slow, 2)
    got.update(wait_traces(rx, refused, 1))
    for t in errors:
        s = check_complete(got[t], tps[t])
        assert s.status_code == STATUS_ERROR
        assert s.attributes["sluice.sampling.reason"] == "error"
        assert s.attributes["http.response.status_code"] == 500
    for t in refused:
        s = check_complete(got[t], None)
        assert s.attributes["sluice.sampling.reason"] == "rejected"
        assert s.attributes["sluice.rejected"] == "no_route"
    for t in slow:
        s = check_complete(got[t], tps[t])
        assert s.attributes["sluice.sampling.reason"] == "slow"
        assert (s.end_ns - s.start_ns) / 1e9 > SLOW_MS / 1000


def test_ok_traces_are_kept_by_the_trace_id_ratio(live: Live) -> None:
    """Exactly the trace ids under ratio·2^64 are kept: a binomial count, decided per id."""
    ids = {new_trace() for _ in range(160)}
    for t in ids:
        assert post(live, "/v1/completions", t) == 200
    expected = {t for t in ids if (t & MASK64) < threshold(RATIO)}
    n, p = len(ids), RATIO
    assert abs(len(expected) - n * p) <= 5 * (n * p * (1 - p)) ** 0.5
    wait_traces(live.rx, expected, 2)
    # A refusal is always kept, and spans are exported in the order they were kept: once this
    # one has arrived, a trace of `ids` kept by mistake would have arrived too.
    marker = new_trace(False)
    assert post(live, "/nowhere", marker) == 404
    wait_traces(live.rx, {marker}, 1)
    arrived = set(live.rx.traces()) & ids
    assert arrived == expected


def test_a_kept_stream_carries_genai_attributes(live: Live) -> None:
    t = new_trace(True)  # kept by the ratio
    req = urllib.request.Request(
        f"http://127.0.0.1:{live.http}/sim/v1/chat/completions",
        data=json.dumps(
            {
                "model": "llama-3-8b",
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "hello there"}],
            }
        ).encode(),
        method="POST",
        headers={"content-type": "application/json", "traceparent": tp(t)},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read().decode()
    assert "[DONE]" in body
    spans = wait_traces(live.rx, {t}, 2)[t]
    server = check_complete(spans, None)
    a = server.attributes
    assert a["gen_ai.request.model"] == "llama-3-8b"
    assert a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.usage.output_tokens"] > 0 and a["gen_ai.usage.input_tokens"] > 0
    assert 0.02 < a["gen_ai.server.time_to_first_token"] < 5
    assert a["sluice.stream.events"] >= 2
    assert 0 <= a["sluice.admission.queue_wait_ms"] < 1000 and a["sluice.priority"] == 0
    assert "first_token" in server.events
    (client,) = [s for s in spans if s.kind == CLIENT]
    assert client.parent_span_id == server.span_id and "first_byte" in client.events
    text = scrape(live)
    assert re.search(
        r'sluice_time_to_first_token_seconds_count\{[^}]*route="sim"[^}]*\} [1-9]', text
    )
    assert re.search(
        r'sluice_inter_token_latency_seconds_count\{[^}]*route="sim"[^}]*\} [1-9]', text
    )
    assert re.search(r'sluice_tokens_total\{[^}]*type="output"[^}]*\} [1-9]', text)


def test_exemplars_carry_kept_trace_ids(live: Live) -> None:
    t = new_trace(True)
    assert post(live, "/v1/completions", t) == 200
    req = urllib.request.Request(
        f"http://127.0.0.1:{live.admin}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        text = r.read().decode()
    assert text.rstrip().endswith("# EOF")
    bucket = r"sluice_request_duration_seconds_bucket\{[^}]*\} [0-9.e+-]+ "
    assert re.search(bucket + r'# \{trace_id="[0-9a-f]{32}"\}', text)
    assert f'trace_id="{t:032x}"' in text
    plain = scrape(live)
    assert "trace_id=" not in plain  # the classic text format has no exemplars
    assert 'sluice_trace_decisions_total{reason="ratio"}' in plain


def latencies(gw: Live, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert post(gw, "/nowhere", new_trace(False)) == 404  # always kept
        out.append(time.perf_counter() - t0)
    return out


def test_a_dead_collector_does_not_slow_requests(
    backend: CaptureBackend, receiver: Receiver, tmp_path: Path, live: Live
) -> None:
    """The exporter points at a socket that accepts connections and never answers: every
    export hangs for its timeout. Requests (all kept: refusals) take no longer than with a
    live collector, spans beyond the export queue are dropped and counted, stop is prompt."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1024)
    tracing = TRACING + (
        f"  exporter: {{protocol: grpc, endpoint: 'http://127.0.0.1:{hole.getsockname()[1]}', "
        "timeout_s: 2, max_queue_spans: 50}\n"
    )
    dead = start(tmp_path, backend, receiver, tracing, live.engine)
    try:
        latencies(live, 20)  # warm both
        latencies(dead, 20)
        base = latencies(live, 150)
        slow = latencies(dead, 150)
        assert max(slow) < 1.0, max(slow)  # an export wait (2 s) never shows in a request
        assert statistics.median(slow) < 3 * statistics.median(base) + 0.010
        wait_until(
            lambda: metric_total(
                scrape(dead), "sluice_trace_dropped_total", reason="export_queue_full"
            ),
            what="spans dropped for a full export queue",
        )
        t0 = time.monotonic()
        assert dead.proc.stop() == 0
        assert time.monotonic() - t0 < 8.0
    finally:
        dead.proc.stop()
        hole.close()


def test_reload_under_traffic_loses_no_kept_trace(
    backend: CaptureBackend, receiver: Receiver, sim: int, tmp_path: Path, live: Live
) -> None:
    """Refused requests (all kept) flow while the policy is reloaded twice: once with new
    sampling parameters (same pipeline), once with a new service name (a new pipeline; the old
    one flushes). Every trace arrives; the access log carries the trace ids."""
    import threading

    exporter = f"  exporter: {{protocol: grpc, endpoint: 'http://127.0.0.1:{receiver.port}'}}\n"
    gw = start(tmp_path, backend, receiver, TRACING + exporter, live.engine, sim, log=True)
    sent: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set() and len(sent) < 20_000:
            t = new_trace(False)
            assert post(gw, "/nowhere", t) == 404
            sent.append(t)

    def reload(tracing: str) -> None:
        path = tmp_path / "policy.yaml"
        ports = (gw.http, gw.grpc, gw.admin)
        write_policy(path, backend, ports, tracing, live.engine, sim, log=True)
        req = urllib.request.Request(f"http://127.0.0.1:{gw.admin}/admin/policy/reload", b"")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200

    def twenty_more() -> None:  # requests answered on the policy now serving
        start = len(sent)
        wait_until(lambda: len(sent) - start, ok=lambda n: n >= 20, what="20 more requests")

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        twenty_more()
        reload(TRACING.replace(f"slow_ms: {SLOW_MS}", "slow_ms: 900") + exporter)
        twenty_more()
        reload(TRACING.replace("sluice-edge", "sluice-edge-2") + exporter)
        twenty_more()
    finally:
        stop.set()
        worker.join(30)
    assert len(sent) > 20
    got = wait_traces(receiver, set(sent), 1)
    services = {got[t][0].service for t in sent}
    assert services == {"sluice-edge", "sluice-edge-2"}
    assert gw.proc.stop() == 0
    log = gw.proc.output()
    assert f'"trace_id":"{sent[-1]:032x}"' in log
