"""TrafficBook: shapes counted per route/backend, a bounded window, no secrets kept."""

from __future__ import annotations

from pathlib import Path

from gateway.core.clock import ManualClock
from gateway.core.histogram import latency_bucket, size_bucket
from gateway.core.request import Wire
from gateway.policy.compiled import CompiledPolicy
from gateway.reload.traffic import (
    BUCKET_S,
    BUCKETS,
    MAX_APPROXIMATE,
    MAX_SHAPES,
    REDACTED,
    TRAFFIC,
    TrafficSnapshot,
)
from tests.reload.traffic_support import BASE, add, book_with, compiled, served


def test_requests_are_counted_by_shape_route_and_backend() -> None:
    p = compiled()
    clock = ManualClock(100.0)
    book = book_with(p, clock, 30, body=300, first_byte=0.02, duration=0.5)
    add(book, p, clock, 10, path="/v1/models", body=0)
    add(book, p, clock, 5, path="/pkg.Svc/Call", protocol=Wire.GRPC)
    snap = book.snapshot()
    assert snap.total == 45
    by = {(s.path, s.route, s.backend): s.stats for s in snap.shapes}
    # The vllm route round-robins over two endpoints of one backend: one shape per backend.
    chat = by[("/v1/chat/completions", "openai", "vllm")]
    assert chat.count == 30
    assert chat.first_byte[latency_bucket(0.02)] == 30
    assert chat.duration[latency_bucket(0.5)] == 30
    assert chat.body[size_bucket(300)] == 30
    assert by[("/v1/models", "openai", "vllm")].body[0] == 10
    assert by[("/pkg.Svc/Call", "grpc", "triton")].count == 5
    assert snap.shapes[0].stats.count == 30  # biggest first


def test_the_window_forgets_old_minutes() -> None:
    p = compiled()
    clock = ManualClock(0.0)
    book = book_with(p, clock, 10)
    for minute in range(1, BUCKETS + 2):
        clock.t = minute * BUCKET_S + 1
        add(book, p, clock, 1)
    snap = book.snapshot()
    # The first minute's 10 have left the window; one per minute of the last BUCKETS stays.
    assert snap.total == BUCKETS
    assert snap.window_s <= BUCKET_S * BUCKETS


def test_shapes_are_bounded_and_overflow_is_kept_by_prefix() -> None:
    p = compiled()
    clock = ManualClock(0.0)
    book = book_with(p, clock, 0)
    for i in range(MAX_SHAPES + 200):
        book.record(served(p, f"/v1/models/m{i}"))
    snap = book.snapshot()
    assert snap.total == MAX_SHAPES + 200
    assert len(snap.shapes) == MAX_SHAPES + 1
    approx = [s for s in snap.shapes if s.stats.approximate]
    assert len(approx) == 1 and approx[0].path == "/v1/" and approx[0].stats.count == 200


def header_routes() -> CompiledPolicy:
    """BASE with a route matching on headers: `x-canary: 1`, and any `authorization`."""
    return compiled(
        BASE.replace(
            "  - name: grpc\n",
            "  - name: canary\n    match: {headers: [{name: x-canary, value: '1'},"
            " {name: authorization}]}\n    backend: vllm\n  - name: grpc\n",
        )
    )


def test_client_chosen_header_values_cannot_grow_the_book_past_its_bound() -> None:
    # A route matching on a header makes its values part of a shape, and a client chooses them:
    # past the approximate shapes too, requests are counted in one shape of their route.
    p = header_routes()
    book = book_with(p, ManualClock(0.0), 0)
    n = MAX_SHAPES + MAX_APPROXIMATE + 5000
    for i in range(n):
        book.record(served(p, headers={"x-canary": f"v{i}"}))
    snap = book.snapshot()
    assert snap.total == n  # every request still counted
    assert len(snap.shapes) == MAX_SHAPES + MAX_APPROXIMATE
    approx = [s for s in snap.shapes if s.stats.approximate]
    assert approx[0].route == "openai" and approx[0].stats.count == 5001
    # A route the folded shapes do not hold yet still gets a shape of its own.
    book.record(served(p, headers={"x-canary": "1", "authorization": "Bearer t"}))
    assert {s.route for s in book.snapshot().shapes} == {"openai", "canary"}


def test_match_headers_are_kept_credentials_redacted() -> None:
    p = header_routes()
    clock = ManualClock(0.0)
    book = book_with(p, clock, 0)
    book.record(served(p, headers={"x-canary": "1", "authorization": "Bearer s3cret"}))
    book.record(served(p, headers={"x-other": "zzz"}))
    snap = book.snapshot()
    dumped = str(snap.as_json())
    assert "s3cret" not in dumped and "zzz" not in dumped
    hdrs = {s.route: dict(s.headers) for s in snap.shapes}
    assert hdrs["canary"] == {"authorization": REDACTED, "x-canary": "1"}
    assert hdrs["openai"] == {"authorization": None, "x-canary": None}


def test_json_round_trip() -> None:
    p = compiled()
    clock = ManualClock(0.0)
    snap = book_with(p, clock, 7).snapshot()
    again = TrafficSnapshot.from_json(snap.as_json())
    assert again == snap


def test_refused_requests_count_their_size_but_not_a_latency() -> None:
    p = compiled()
    clock = ManualClock(0.0)
    book = book_with(p, clock, 0)
    book.record(served(p, body=5000, answered=False))
    st = book.snapshot().shapes[0].stats
    assert st.count == 1
    assert st.body[size_bucket(5000)] == 1  # from Content-Length: the body was never read
    assert sum(st.first_byte) == sum(st.duration) == 0


def test_the_book_outlives_a_reload(tmp_path: Path) -> None:
    from gateway.app import Gateway

    path = tmp_path / "policy.yaml"
    path.write_text(BASE)
    gw = Gateway(path)
    book = gw.traffic
    for _ in range(5):
        book.record(served(gw.active.policy))
    path.write_text(BASE.replace("9001", "9002"))
    assert gw.holder.reload().changed
    assert gw.traffic is book is gw.services.peek(TRAFFIC)
    assert book.snapshot().total == 5
    assert gw.services.state()["traffic"]["requests"] == 5
