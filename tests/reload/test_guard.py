"""The change guard on recorded traffic: each outage-shaped change is held, with its routes and
shares; harmless changes, already-failing traffic and too little traffic are not."""

from __future__ import annotations

import pytest

from gateway.core.clock import ManualClock
from gateway.core.request import Wire
from gateway.policy.model import Guard
from gateway.reload.guard import check_change, static_warnings
from tests.reload.traffic_support import BASE, add, book_with, compiled, served

ALL_WEIGHTS_0 = BASE.replace('"127.0.0.1:9000"}', '"127.0.0.1:9000", weight: 0}').replace(
    "weight: 2}", "weight: 0}"
)
NO_ROUTES = BASE[: BASE.index("routes:")] + "routes: []\n"
TINY_FIRST_BYTE = BASE + "timeouts: {first_byte_s: 0.000001}\n"
TINY_BODY = BASE + "limits: {max_body_bytes: 1}\n"
GUARD = Guard()


def traffic(n_http: int = 90, n_grpc: int = 10):  # type: ignore[no-untyped-def]
    p = compiled()
    clock = ManualClock(1000.0)
    book = book_with(p, clock, n_http, body=300, first_byte=0.02, duration=0.4)
    add(book, p, clock, n_grpc, path="/pkg.Svc/Call", protocol=Wire.GRPC, body=50)
    return p, book.snapshot()


@pytest.mark.parametrize(
    ("text", "kind", "route", "share"),
    [
        pytest.param(ALL_WEIGHTS_0, "no_endpoint", "openai", 0.9, id="all-weights-0"),
        pytest.param(NO_ROUTES, "no_route", "openai", 0.9, id="routes-empty"),
        pytest.param(TINY_FIRST_BYTE, "first_byte_timeout", "openai", 0.9, id="first-byte"),
        pytest.param(TINY_BODY, "body_too_large", "openai", 0.9, id="max-body-1"),
    ],
)
def test_outage_shaped_changes_are_held(text: str, kind: str, route: str, share: float) -> None:
    old, snap = traffic()
    report = check_change(old, compiled(text), snap, GUARD)
    assert report.held, report.lines()
    top = report.findings[0]
    assert (top.kind, top.route, top.requests) == (kind, route, 90)
    assert top.share == pytest.approx(share)
    lines = report.lines()
    assert lines[0].startswith("guard: HELD: ")
    assert "90 of 100 requests" in lines[0] or "100.0%" in lines[0]
    assert any(f"{kind}: 90.0% (90 requests, route {route}" in line for line in lines), lines
    assert lines[-1].endswith("POST /admin/policy/reload?force=1)")


def test_no_routes_takes_grpc_down_too() -> None:
    old, snap = traffic()
    report = check_change(old, compiled(NO_ROUTES), snap, GUARD)
    assert report.share == pytest.approx(1.0)
    assert {(f.kind, f.route) for f in report.findings} == {
        ("no_route", "openai"),
        ("no_route", "grpc"),
    }
    assert static_warnings(compiled(NO_ROUTES).policy)[0].startswith("the policy has no routes")


def test_a_change_below_the_threshold_goes_through_with_its_findings() -> None:
    old, snap = traffic(n_http=60, n_grpc=40)
    # Only the gRPC route loses its endpoint: 40 % < 50 %.
    text = BASE.replace('"127.0.0.1:9100"}', '"127.0.0.1:9100", weight: 0}')
    report = check_change(old, compiled(text), snap, GUARD)
    assert not report.held
    assert report.share == pytest.approx(0.4)
    assert report.findings[0].kind == "no_endpoint" and report.findings[0].route == "grpc"
    assert check_change(old, compiled(text), snap, Guard(max_affected_share=0.3)).held


def test_harmless_changes_are_not_held() -> None:
    old, snap = traffic()
    for text in (
        BASE.replace("9001", "9002"),  # an endpoint moves
        BASE + "timeouts: {first_byte_s: 1.0}\n",  # shorter but above what was observed
        BASE + "limits: {max_body_bytes: 4096}\n",  # smaller but above every body seen
        BASE.replace("path_prefix: /v1/", "path_prefix: /v1"),
    ):
        report = check_change(old, compiled(text), snap, GUARD)
        assert not report.held and report.affected == 0, (text, report.lines())


def test_traffic_that_already_failed_is_not_the_changes_doing() -> None:
    # The running policy has no route for /v2/: those requests 404 today and will tomorrow.
    old = compiled()
    clock = ManualClock(0.0)
    book = book_with(old, clock, 80, body=10)
    add(book, old, clock, 20, path="/v2/x")
    report = check_change(old, compiled(BASE.replace("/v1/", "/v3/")), book.snapshot(), GUARD)
    assert report.affected == 80 and report.held


def test_too_little_traffic_is_not_judged() -> None:
    old, snap = traffic(n_http=5, n_grpc=0)
    report = check_change(old, compiled(NO_ROUTES), snap, GUARD)
    assert not report.held
    assert "nothing to judge" in report.lines()[0]
    assert report.warnings  # the static problem is still said


def test_route_timeouts_override_per_route() -> None:
    old, snap = traffic()
    text = BASE.replace("    backend: vllm\n", "    backend: vllm\n    timeouts: {total_s: 0.1}\n")
    report = check_change(old, compiled(text), snap, GUARD)
    kinds = {f.kind for f in report.findings}
    # A per-route `timeouts` replaces the global ones: total 0.1 s < the observed 0.4 s.
    assert "total_timeout" in kinds and report.held


def test_disabled_guard_reports_but_never_holds() -> None:
    old, snap = traffic()
    report = check_change(old, compiled(NO_ROUTES), snap, Guard(enabled=False))
    assert not report.held and report.share > 0.5


def test_latency_of_answered_requests_applies_to_refused_ones_of_the_same_shape() -> None:
    # Most of the window was refused in microseconds under an earlier (forced) policy with no
    # route; the answered ones say how long a backend takes for this request.
    old = compiled()
    clock = ManualClock(0.0)
    book = book_with(old, clock, 20, first_byte=0.02)
    no_route = compiled(NO_ROUTES)
    for _ in range(500):
        book.record(served(no_route, answered=False, started=clock.t - 0.00002))
    report = check_change(old, compiled(TINY_FIRST_BYTE), book.snapshot(), GUARD)
    assert report.held and report.affected == 520, report.lines()
