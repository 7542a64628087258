"""The client's response head built from an upstream head (`gateway.forward.headers.client_head`):
what is dropped, what is noted, in any case the upstream spells the names, and the same the
second time a spelling is seen (the kinds are learned by the name as sent)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest

from gateway.context import RequestContext
from gateway.forward.headers import BadUpstreamHead, client_head, overhead_line
from tests.forward.heads import SPELLINGS, request_context


def ctx(request_id: str = "rid-1") -> RequestContext:
    c = request_context()
    c.request_id = request_id
    c.started = c.upstream_s = 0.0
    return c


def lines_of(block: bytes) -> list[bytes]:
    return [line for line in block.split(b"\r\n") if line]


@pytest.mark.parametrize("case", SPELLINGS)
def test_dropped_noted_and_passed_in_any_case(case: Callable[[str], str]) -> None:
    def name(s: str) -> bytes:
        return case(s).encode()

    upstream = [
        (name("Content-Length"), b"12"),
        (name("Connection"), b"keep-alive, x-secret"),
        (name("X-Secret"), b"hop"),
        (name("Keep-Alive"), b"timeout=5"),
        (name("X-Sluice-Overhead-Ms"), b"9.000"),
        (name("Date"), b"Sun, 06 Dec 2026 14:00:00 GMT"),
        (name("Content-Type"), b"Application/JSON"),
        (name("Server"), b"model-server"),
    ]
    for _ in range(2):  # the second time, by the kinds learned from the first
        head = client_head(200, upstream, ctx())
        assert head.length == 12 and not head.chunked
        assert head.date and head.content_type == b"application/json"
        got = lines_of(head.lines)
        assert [n.lower() for n, _, _ in (line.partition(b": ") for line in got)] == [
            b"date",
            b"content-type",
            b"server",
            b"x-request-id",
            b"x-sluice-overhead-ms",
        ]
        assert got[-2] == b"x-request-id: rid-1"
        assert re.fullmatch(rb"x-sluice-overhead-ms: \d+\.\d{3}", got[-1])


@pytest.mark.parametrize(
    ("ago", "upstream"), [(-5.0, 0.0), (0.0004, 0.0), (0.0123, 0.01), (7.5, 2.0)]
)
def test_the_overhead_is_milliseconds_with_three_decimals(ago: float, upstream: float) -> None:
    """`x-sluice-overhead-ms`: the overhead kept on the context, in milliseconds with exactly
    three decimals (leading zeros kept), never negative."""
    c = ctx()
    c.started, c.upstream_s = time.monotonic() - ago, upstream
    line = overhead_line(c)
    assert c.overhead_s >= 0.0
    us = int(c.overhead_s * 1_000_000.0 + 0.5)
    assert line == b"x-sluice-overhead-ms: %d.%03d\r\n" % (us // 1000, us % 1000)
    assert abs(float(line[22:-2]) - max(0.0, ago - upstream) * 1000) < 50  # (a slow machine)
    if ago < 0:
        assert line == b"x-sluice-overhead-ms: 0.000\r\n"


def test_an_upstream_request_id_is_kept_and_chunked_wins_over_a_length() -> None:
    upstream = [
        (b"X-Request-ID", b"theirs"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Content-Length", b"5"),
    ]
    head = client_head(200, upstream, ctx())
    assert head.chunked and head.length is None
    assert [line for line in lines_of(head.lines) if b"request" in line.lower()] == [
        b"X-Request-ID: theirs"
    ]


@pytest.mark.parametrize(
    ("status", "headers"),
    [(99, []), (600, []), (200, [(b"Content-Length", b"1x")]), (200, [(b"CONTENT-length", b"-1")])],
)
def test_what_cannot_be_passed_on(status: int, headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(BadUpstreamHead):
        client_head(status, headers, ctx())


@pytest.mark.parametrize("seconds", [0.0, 0.0123456, 2.5])
def test_the_overhead_reads_as_milliseconds_with_three_decimals(seconds: float) -> None:
    c = ctx()
    c.started = time.monotonic() - seconds  # less the upstream's time (none here)
    value = lines_of(client_head(204, [], c).lines)[-1].partition(b": ")[2]
    assert re.fullmatch(rb"\d+\.\d{3}", value)
    assert seconds * 1000 <= float(value) < seconds * 1000 + 1000  # the clock moved on a bit
    assert c.overhead_s * 1000 == pytest.approx(float(value), abs=0.0006)
