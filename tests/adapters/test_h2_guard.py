"""The HTTP/2 frame guard, table-driven: frame headers in, a breach (or none) out."""

from __future__ import annotations

import types

import hpack
import pytest
from h2.connection import H2Connection
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from gateway.adapters.h2 import guard as g
from gateway.policy.base import Http2Limits


def _f(frame: object, **attrs: object) -> bytes:
    for k, v in attrs.items():
        setattr(frame, k, v)
    return frame.serialize()  # type: ignore[attr-defined]


def headers(sid: int, end_headers: bool = True) -> bytes:
    flags = {"END_HEADERS"} if end_headers else set()
    return _f(HeadersFrame(sid), data=b"\x82", flags=flags)


PING = _f(PingFrame(0), opaque_data=b"12345678")
EMPTY = DataFrame(1).serialize()
LAST = _f(DataFrame(1), flags={"END_STREAM"})
CONT = _f(ContinuationFrame(1), data=b"\x00" * 100)
CONT_BIG = _f(ContinuationFrame(1), data=b"\x00" * 16000)
PRIO = _f(PriorityFrame(1), depends_on=0, stream_weight=16)
WU = _f(WindowUpdateFrame(0), window_increment=1)
SETTINGS = SettingsFrame(0).serialize()


@pytest.mark.parametrize(
    ("frames", "breach"),
    [
        (PING * 100, None),
        (PING * 101, g.PING_FLOOD),
        (SETTINGS * 10, None),
        (SETTINGS * 11, g.SETTINGS_FLOOD),
        (headers(1) + EMPTY, None),
        (headers(1) + EMPTY + EMPTY, g.EMPTY_FRAMES),
        (headers(1) + EMPTY + _f(DataFrame(1), data=b"x") + EMPTY, None),
        (headers(1) + EMPTY + LAST, None),
        (headers(1, False) + CONT * 8, None),
        (headers(1, False) + CONT * 9, g.CONTINUATION_FLOOD),
        (headers(1, False) + CONT_BIG * 2, None),  # 32,001 bytes: the default cap is 32 KiB
        (headers(1, False) + CONT_BIG * 2 + CONT, None),  # 32,101 bytes
        (headers(1, False) + CONT_BIG * 3, g.HEADER_BLOCK_TOO_LARGE),
        (PRIO * 100, None),
        (PRIO * 101, g.PRIORITY_FLOOD),
        (headers(1) + PRIO * 200, None),
        (WU * 5, None),
        (WU * 6, g.WINDOW_UPDATE_FLOOD),
        (b"".join(headers(2 * i + 1) for i in range(200)), None),
        (b"".join(headers(2 * i + 1) for i in range(201)), g.NEW_STREAMS_FLOOD),
        (b"\x00\x40\x01\x00\x00\x00\x00\x00\x01", g.FRAME_TOO_LARGE),  # 16,385 declared
    ],
)
def test_breaches(frames: bytes, breach: g.Breach | None) -> None:
    guard = g.FrameGuard(Http2Limits())
    assert guard.feed(g.PREFACE + frames, 0.0) is breach


def test_bytes_split_anywhere_count_the_same() -> None:
    data = g.PREFACE + headers(1, False) + CONT * 9
    for cut in range(1, len(data)):
        guard = g.FrameGuard(Http2Limits())
        first = guard.feed(data[:cut], 0.0)
        second = guard.feed(data[cut:], 0.0) if first is None else first
        assert second is g.CONTINUATION_FLOOD, cut


def test_rates_are_per_second_and_streams_per_read() -> None:
    guard = g.FrameGuard(Http2Limits())
    assert guard.feed(g.PREFACE + PING * 100, 0.0) is None
    assert guard.feed(PING, 0.5) is g.PING_FLOOD
    guard = g.FrameGuard(Http2Limits())
    assert guard.feed(g.PREFACE + PING * 100, 0.0) is None
    assert guard.feed(PING * 100, 1.0) is None  # a new second
    guard = g.FrameGuard(Http2Limits())
    assert guard.feed(g.PREFACE + b"".join(headers(2 * i + 1) for i in range(200)), 0.0) is None
    assert guard.feed(b"".join(headers(2 * i + 401) for i in range(200)), 0.0) is None


def test_window_updates_grow_with_data_sent() -> None:
    guard = g.FrameGuard(Http2Limits())
    guard.data_sent = 1
    assert guard.feed(g.PREFACE + WU * 25, 0.0) is None
    assert guard.feed(WU, 0.0) is g.WINDOW_UPDATE_FLOOD


def test_a_wrong_preface_is_refused() -> None:
    assert g.FrameGuard(Http2Limits()).feed(b"PRI * HTTP/1.1\r\n", 0.0) is g.BAD_PREFACE


def test_frame_too_large_is_seen_before_its_payload() -> None:
    guard = g.FrameGuard(Http2Limits())
    assert guard.feed(g.PREFACE + b"\xff\xff\xff\x00\x00\x00\x00\x00", 0.0) is None
    assert guard.feed(b"\x01", 0.0) is g.FRAME_TOO_LARGE


def test_refusals_are_free_up_to_an_allowance_refilled_per_second() -> None:
    guard = g.FrameGuard(Http2Limits(max_concurrent_streams=10))
    assert [guard.refusal_counts(100.0) for _ in range(21)] == [False] * 20 + [True]
    assert [guard.refusal_counts(100.5) for _ in range(6)] == [False] * 5 + [True]
    assert [guard.refusal_counts(110.0) for _ in range(21)] == [False] * 20 + [True]  # no more


@pytest.mark.parametrize(
    ("streams", "pieces"),
    [
        (1, 1),
        (g.STREAMS_PER_TURN, 1),
        (g.STREAMS_PER_TURN + 1, 2),
        (200, -(-200 // g.STREAMS_PER_TURN)),
    ],
)
def test_a_read_of_many_new_streams_is_cut_before_every_turns_first(
    streams: int, pieces: int
) -> None:
    """`cuts` split a read at frame starts so that each piece opens at most STREAMS_PER_TURN
    streams (the connection feeds h2 one piece per turn of the event loop); frames that open
    no stream stay with the piece before them."""
    frames = [g.PREFACE] + [headers(2 * i + 1) + PING for i in range(streams)]
    data = b"".join(frames)
    guard = g.FrameGuard(Http2Limits(max_pings_per_s=1000))
    assert guard.feed(data, 0.0) is None
    ends = [0, *guard.cuts, len(data)]
    assert len(ends) - 1 == pieces
    for a, b in zip(ends, ends[1:], strict=False):
        piece = data[a:b]
        opened = g.FrameGuard(Http2Limits(max_pings_per_s=1000))
        opened.preface_left = 0 if a else len(g.PREFACE)
        assert opened.feed(piece, 0.0) is None and not opened.skip and not opened.head
        assert 1 <= opened.streams_opened <= g.STREAMS_PER_TURN
    assert guard.feed(PING, 0.0) is None and guard.cuts == []  # each read has its own


def test_h2s_walk_of_its_stream_table_is_amortized() -> None:
    """h2 walks every stream it holds on each new stream (to count the open ones); the server
    connection walks once the table has doubled, and closed streams are still moved out."""
    h2c = g.server_h2(Http2Limits())
    g.start_h2(h2c, Http2Limits())
    h2c.data_to_send()
    h2c.receive_data(g.PREFACE + SETTINGS)
    enc = hpack.Encoder()
    block = enc.encode([(":method", "GET"), (":scheme", "http"), (":path", "/"),
                        (":authority", "x")])  # fmt: skip
    walks = 0
    real = h2c._open_streams

    def counted(remainder: int) -> int:
        nonlocal walks
        walks += 1
        return real(remainder)

    h2c._open_streams = counted  # type: ignore[method-assign]
    for i in range(1000):
        sid = 2 * i + 1
        h2c.receive_data(_f(HeadersFrame(sid), data=block, flags={"END_HEADERS", "END_STREAM"}))
        h2c.send_headers(sid, [(b":status", b"200")], end_stream=True)  # closed at once
    assert walks <= 1000 // g.SWEEP_MIN, walks  # h2 alone walks 1000 times
    assert len(h2c.streams) < 2 * g.SWEEP_MIN


REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/"), (":authority", "x")]


def _transcript(h2c: H2Connection, steps: list[bytes | int]) -> list[object]:
    """Feed each step (frames, or the id of a stream to answer with END_STREAM) to `h2c`; what
    came out of each: the events' types, the frames sent (type, stream, error code), or the
    exception raised (which ends the connection)."""
    g.start_h2(h2c, Http2Limits())
    h2c.data_to_send()
    h2c.receive_data(g.PREFACE + SETTINGS)
    h2c.data_to_send()
    out: list[object] = []
    for step in steps:
        try:
            if isinstance(step, int):
                h2c.send_headers(step, [(b":status", b"200")], end_stream=True)
                out.append("answered")
            else:
                out.append([type(e).__name__ for e in h2c.receive_data(step)])
        except Exception as e:  # noqa: BLE001 - the exception is the transcript
            out.append(type(e).__name__)
            break
        sent, pos = h2c.data_to_send(), 0
        while pos < len(sent):
            f, n = Frame.parse_frame_header(memoryview(sent[pos : pos + 9]))
            f.parse_body(memoryview(sent[pos + 9 : pos + 9 + n]))
            out.append((type(f).__name__, f.stream_id, getattr(f, "error_code", None)))
            pos += 9 + n
    return out


def _scenario(case: int) -> list[bytes | int]:
    enc = hpack.Encoder()  # each scenario on a connection of its own

    def head(sid: int, end: bool = False) -> bytes:
        flags = {"END_HEADERS", "END_STREAM"} if end else {"END_HEADERS"}
        return _f(HeadersFrame(sid), data=enc.encode(REQUEST), flags=flags)

    def data(sid: int, end: bool = False) -> bytes:
        return _f(DataFrame(sid), data=b"{}", flags={"END_STREAM"} if end else set())

    rst = _f(RstStreamFrame(1), error_code=8)
    scenarios = [  # built lazily: the HPACK state is the one connection's
        lambda: [head(1) + data(1, True), 1, data(1)],  # DATA on a stream both sides ended
        lambda: [head(1) + rst, data(1), data(1)],  # DATA on a stream after its reset
        lambda: [head(1, True), 1, head(1)],  # HEADERS again on an ended stream
        lambda: [head(1), head(5), data(3)],  # a stream closed implicitly by a higher one
        lambda: [head(1) + rst, head(3), data(1)],  # a reset stream below the highest
    ]
    return scenarios[case]()


@pytest.mark.parametrize("case", range(5))
def test_frames_are_received_as_h2_receives_them_without_formatting(
    case: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """h2's own `_receive_frame` formats `repr(frame)` for every frame received, for a trace
    log; the server connection's does not, and otherwise answers as h2's: the same events, the
    same frames sent (RST_STREAM STREAM_CLOSED for a frame on a stream the client reset), the
    same connection errors. Each scenario is run through both, with fresh HPACK state."""
    formatted: list[object] = []
    ours = _transcript(g.server_h2(Http2Limits()), _scenario(case))
    monkeypatch.setattr(Frame, "__repr__", lambda f: formatted.append(f) or "frame")
    ours_again = _transcript(g.server_h2(Http2Limits()), _scenario(case))
    assert formatted == []
    stock = g.server_h2(Http2Limits())
    stock._receive_frame = types.MethodType(H2Connection._receive_frame, stock)  # type: ignore[method-assign]
    theirs = _transcript(stock, _scenario(case))
    assert formatted  # h2's formats every frame
    assert ours == ours_again == theirs, (ours, theirs)
    last = ours[-1]  # the late frame: answered with RST_STREAM, or the connection ended
    assert last in ("StreamClosedError", ("RstStreamFrame", last[1], 5)), ours
