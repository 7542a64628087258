"""HTTP/2 limits and ends that need a gateway of their own (short timeouts, a small request cap
per connection): the header and idle timers, GOAWAY after max_requests_per_connection (httpx
goes on over a new connection), streams reset before they were served are still accounted, and
a stream cut by a deadline ends with an SSE error event and a clean END_STREAM."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hyperframe.frame import DataFrame, GoAwayFrame, HeadersFrame, WindowUpdateFrame

from tests.integration.conftest import Backend
from tests.integration.h2_support import (
    CHAT,
    H2Gateway,
    RawH2,
    frame,
    ping,
    rst,
    start_h2_gateway,
)
from tests.support import wait_until

pytestmark = pytest.mark.integration

LIMITS = "limits:\n  max_buffered_body_bytes: 65536\n  http2: {max_requests_per_connection: 5}\n"
TIMEOUTS = ", header_read_s: 1, keepalive_s: 1, total_s: 1.5"


@pytest.fixture(scope="module")
def gw(backend: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[H2Gateway]:
    g = start_h2_gateway(backend, tmp_path_factory.mktemp("h2limits"), LIMITS, TIMEOUTS)
    try:
        yield g
    finally:
        assert g.proc.stop() == 0, g.proc.output()


def closed_after(conn: RawH2, within: float) -> float | None:
    """Seconds until the server closed the connection (frames read meanwhile), or None."""
    start = time.monotonic()
    for _ in conn.frames(within):
        pass
    elapsed = time.monotonic() - start
    return elapsed if elapsed < within else None


def test_header_timeout_closes_a_connection_that_sends_no_request(gw: H2Gateway) -> None:
    conn = RawH2(gw.port)
    elapsed = closed_after(conn, 4.0)
    conn.close()
    assert elapsed is not None and 0.8 < elapsed < 2.5


def test_header_timeout_closes_a_header_block_left_open(gw: H2Gateway) -> None:
    conn = RawH2(gw.port)
    conn.send(conn.headers(1, end_headers=False))
    elapsed = closed_after(conn, 4.0)
    conn.close()
    assert elapsed is not None and elapsed < 2.5


def test_a_header_block_left_open_on_a_kept_connection_is_cut_at_header_read_s(
    backend: Backend, tmp_path: Path
) -> None:
    """A connection served one request, idle past `header_read_s` (its deadline now the
    keep-alive one, 30 s away), then a header block left open: cut `header_read_s` after it
    opened, not at the keep-alive deadline."""
    g = start_h2_gateway(backend, tmp_path, "", ", header_read_s: 0.5, keepalive_s: 30")
    try:
        conn = RawH2(g.port)
        conn.send(conn.headers(1))  # GET /v1/models
        assert any(isinstance(f, HeadersFrame) and f.stream_id == 1 for f in conn.frames(1.2))
        conn.send(conn.headers(3, end_headers=False))  # and never the CONTINUATION
        elapsed = closed_after(conn, 5.0)
        conn.close()
        assert elapsed is not None and 0.3 < elapsed < 2.0, elapsed
    finally:
        assert g.proc.stop() == 0, g.proc.output()


def test_idle_connection_gets_goaway_and_close(gw: H2Gateway) -> None:
    conn = RawH2(gw.port)
    conn.send(conn.headers(1))  # GET /v1/models
    got: list[object] = []
    start = time.monotonic()
    for f in conn.frames(4.0):
        got.append(f)
    elapsed = time.monotonic() - start
    conn.close()
    assert any(isinstance(f, HeadersFrame) and f.stream_id == 1 for f in got)
    assert isinstance(got[-1], GoAwayFrame) and got[-1].error_code == 0
    assert 0.8 < elapsed < 2.5


def test_requests_per_connection_then_goaway_and_httpx_reconnects(gw: H2Gateway) -> None:
    conn = RawH2(gw.port)
    conn.send(b"".join(conn.headers(2 * i + 1) for i in range(6)))
    answered, refused, goaway = set(), set(), None
    for f in conn.frames(3.0):
        if isinstance(f, HeadersFrame):
            answered.add(f.stream_id)
        elif isinstance(f, GoAwayFrame):
            goaway = f
        elif f.__class__.__name__ == "RstStreamFrame":
            refused.add(f.stream_id)
    conn.close()
    assert answered == {1, 3, 5, 7, 9} and refused == {11}
    assert goaway is not None and goaway.last_stream_id == 9 and goaway.error_code == 0
    with httpx.Client(http1=False, http2=True, timeout=10) as c:
        codes = [c.get(f"{gw.url}/v1/models").status_code for _ in range(12)]
    assert codes == [200] * 12


def test_streams_reset_before_they_were_served_are_accounted(gw: H2Gateway) -> None:
    before = gw.metric("sluice_client_cancelled_total", protocol="http")
    conn = RawH2(gw.port)
    for i in range(4):  # under the request cap: the resets are all the connection does
        sid = 2 * i + 1
        conn.send(conn.headers(sid, "POST", "/v1/chat/completions", end_stream=False) + rst(sid))
    wait_until(lambda: gw.metric("sluice_client_cancelled_total", protocol="http") - before,
               ok=lambda n: n >= 4, what="four cancelled streams counted")  # fmt: skip
    conn.close()
    assert gw.metric("sluice_client_cancelled_total", protocol="http") - before == 4


def test_a_stream_cut_by_its_deadline_ends_with_an_sse_error_event(
    gw: H2Gateway, backend: Backend
) -> None:
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 500}).encode()
    backend.knobs(completion_tokens=500)  # 10 s of tokens; the deadline (total_s) is 1.5 s
    try:
        data, ended = _stream(gw, body)
    finally:
        backend.knobs(completion_tokens=16)
    assert ended, data[-300:]
    events = [e for e in data.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]"
    assert b"upstream_timeout" in events[-2]


def _stream(gw: H2Gateway, body: bytes) -> tuple[bytes, bool]:
    conn = RawH2(gw.port)
    conn.send(
        conn.headers(
            1,
            "POST",
            "/v1/chat/completions",
            end_stream=False,
            extra=[("content-type", "application/json")],
        )  # fmt: skip
        + frame(DataFrame(1), data=body, flags={"END_STREAM"})
    )
    data, ended = b"", False
    for f in conn.frames(4.0):
        if isinstance(f, DataFrame) and f.stream_id == 1:
            data += f.data
            if "END_STREAM" in f.flags:
                ended = True
                break
    conn.close()
    return data, ended


def test_large_body_streams_through_the_stream_window(gw: H2Gateway) -> None:
    """800 KB (above max_buffered_body_bytes here: streamed to the backend) through a 64 KiB
    stream window that is returned as the upstream write takes the bytes."""
    body = {**CHAT, "messages": [{"role": "user", "content": "w " * 400_000}]}
    with httpx.Client(http1=False, http2=True, timeout=10) as c:
        r = c.post(f"{gw.url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 1000


def test_a_client_that_does_not_read_its_answers_is_cut(backend: Backend, tmp_path: Path) -> None:
    """PINGs within the rate (here 10^6/s) from a client that never reads: once the answers
    fill the socket buffers (several MB on loopback) with no stream open, the connection is
    cut, counted as control_queue. (With the default rate the PING limit cuts it at once.)"""
    gw = start_h2_gateway(backend, tmp_path, "limits:\n  http2: {max_pings_per_s: 1000000}\n")
    try:
        # How long the buffers take to fill is the gateway's CPU speed (about 1-2 s here,
        # nearly 5 s on a loaded 2-core machine): the test asks for the cut, not its speed.
        cut = _flood_pings(gw.port)
        assert cut is not None, "never cut"
        assert gw.metric("sluice_rejected_total", reason="h2_control_queue") == 1
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


def _flood_pings(port: int) -> float | None:
    conn = RawH2(port)
    conn.sock.settimeout(0.5)
    start = time.monotonic()
    cut = None
    while time.monotonic() - start < 15 and cut is None:
        try:
            conn.sock.sendall(b"".join(ping(i) for i in range(500)))
        except TimeoutError:
            continue
        except OSError:
            cut = time.monotonic() - start
    conn.close()
    return cut


def test_a_large_answer_to_a_client_that_reads_late_is_delivered(
    gw: H2Gateway, backend: Backend
) -> None:
    """A large answer (100,000 tokens) to a client with a large window and a small receive
    buffer that reads only once the gateway has ended the stream (and counted the request):
    the socket buffers are full, the connection waits for the client and the answer arrives
    whole (a full buffer is taken for a flood only when no response was written into it)."""
    backend.knobs(completion_tokens=100_000, token_delay_ms=0)
    answered = gw.metric("sluice_requests_total", code="200")
    try:
        conn = RawH2(gw.port, settings={4: 1 << 30}, rcvbuf=8192)  # 4: INITIAL_WINDOW_SIZE
        conn.send(frame(WindowUpdateFrame(0), window_increment=(1 << 30)))
        body = json.dumps({**CHAT, "max_tokens": 100_000}).encode()
        conn.send(
            conn.headers(
                1,
                "POST",
                "/v1/chat/completions",
                end_stream=False,
                extra=[("content-type", "application/json")],
            )  # fmt: skip
            + frame(DataFrame(1), data=body, flags={"END_STREAM"})
        )
        # The whole answer is in the gateway's buffers, full since nothing is read; the scrape
        # is answered after that write, so after any cut it would have caused.
        wait_until(lambda: gw.metric("sluice_requests_total", code="200") - answered,
                   ok=lambda n: n == 1, what="the answer counted, nothing read")  # fmt: skip
        data, ended = b"", False
        for f in conn.frames(5.0):
            if isinstance(f, DataFrame) and f.stream_id == 1:
                data += f.data
                if "END_STREAM" in f.flags:
                    ended = True
                    break
        conn.close()
    finally:
        backend.knobs(completion_tokens=16, token_delay_ms=20)
    assert ended and len(data) > 300_000
    assert json.loads(data)["usage"]["completion_tokens"] == 100_000
