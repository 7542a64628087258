"""The HTTP/2 attack table against the gRPC listener on the HTTP/2 engine
(`listeners.grpc.engine: h2`, h2c, no datapath): each flood ends the attacking connection
within 2 s, counted under its reason, with bounded memory, while a grpcio client is served."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hpack import Decoder
from hyperframe.frame import DataFrame, GoAwayFrame, HeadersFrame

from gateway.proto import load
from tests.integration.conftest import Backend, wait_ready
from tests.integration.h2_support import H2Gateway, RawH2, refused_streams
from tests.integration.test_grpc_engines import SECRET_ENV, policy_text
from tests.integration.test_h2_attacks import ATTACKS, flood
from tests.support import Proc, free_port, wait_until

pytestmark = pytest.mark.integration

pb2, pb2_grpc = load()
CLOSE_WITHIN_S = 2.0
COLLECT = "/sluice.inference.v1.Inference/Collect"
INFER = "/sluice.inference.v1.Inference/Infer"
GRPC_HEADERS = [("content-type", "application/grpc"), ("te", "trailers")]


@pytest.fixture(scope="module")
def gw(backend: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[H2Gateway]:
    tmp = tmp_path_factory.mktemp("grpc-h2-attacks")
    port, admin = free_port(), free_port()
    path = tmp / "policy.yaml"
    path.write_text(
        policy_text(backend, "h2", port, admin, limits=", grpc_max_concurrent_streams: 100")
    )
    proc = Proc(["serve", "--policy", str(path)], tmp / "gateway.log", env={SECRET_ENV: "s" * 32})
    wait_ready(admin, proc)
    try:
        yield H2Gateway(proc, port, admin)
    finally:
        assert proc.stop() == 0, proc.output()


class GrpcBystander:
    """A grpcio client calling all along; every call must succeed within 2 s."""

    def __init__(self, gw: H2Gateway) -> None:
        self.gw = gw
        self.stop = threading.Event()
        self.results: list[tuple[bool | str, float]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.gw.port}") as ch:
            stub = pb2_grpc.InferenceStub(ch)
            req = pb2.InferRequest(prompt="x", max_tokens=1)
            md = (("x-rl-tenant", "bystander"),)  # not the attackers' shared bucket
            while not self.stop.is_set():
                t = time.monotonic()
                try:
                    ok = stub.Infer(req, metadata=md, timeout=5).usage
                    good: bool | str = ok.total_tokens > 0
                except grpc.RpcError as e:
                    good = str(e)
                self.results.append((good, time.monotonic() - t))
                time.sleep(0.05)

    def __enter__(self) -> GrpcBystander:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        assert self.results, "the normal client made no call"
        assert all(good is True for good, _ in self.results), self.results
        assert max(t for _, t in self.results) < 2.0, self.results


@pytest.mark.parametrize("name", list(ATTACKS))
def test_flood_closes_the_connection_quickly(gw: H2Gateway, name: str) -> None:
    reason, make, pause = ATTACKS[name]
    label = "h2_" + reason
    before = gw.metric("sluice_rejected_total", reason=label, protocol="grpc")
    rss = gw.rss_kb()
    with GrpcBystander(gw) as normal:
        conn = RawH2(gw.port)
        elapsed = flood(conn, make(conn), pause)
        conn.close()
        wait_until(lambda: gw.metric("sluice_rejected_total", reason=label, protocol="grpc"),
                   ok=lambda n: n >= before + 1, what=f"{label} counted")  # fmt: skip
        served = len(normal.results)
        wait_until(lambda: len(normal.results) > served, what="the normal client served after")
    assert elapsed < CLOSE_WITHIN_S, f"{name}: connection open after {elapsed:.1f}s"
    assert gw.metric("sluice_rejected_total", reason=label, protocol="grpc") == before + 1
    assert gw.rss_kb() - rss < 20 * 1024, "memory grew more than 20 MB"


def _calls(conn: RawH2, batch: int) -> Callable[[int], bytes]:
    """Batches of client-streaming calls that never send a message (held open)."""

    def chunk(i: int) -> bytes:
        return b"".join(
            conn.headers(1 + 2 * (i * batch + k), "POST", COLLECT, False, extra=GRPC_HEADERS)
            for k in range(batch)
        )

    return chunk


def test_stream_exhaustion_refuses_streams_then_closes(gw: H2Gateway) -> None:
    """Calls past max concurrent streams (100 here) get RST_STREAM REFUSED_STREAM and the
    connection lives on; a client that keeps opening streams it cannot have gets GOAWAY."""
    conn = RawH2(gw.port)
    make = _calls(conn, 50)
    conn.send(make(0) + make(1) + make(2))
    refused, goaway = refused_streams(conn)
    assert goaway is None
    assert len(refused) == 50 and min(refused) == 201, sorted(refused)[:3]
    with GrpcBystander(gw) as normal:
        elapsed = flood(conn, lambda i: make(3 + i), 0.005)
        wait_until(lambda: normal.results, what="the normal client served")  # the cut may be quick
    conn.close()
    assert elapsed < CLOSE_WITHIN_S


def test_calls_past_the_limit_are_refused_one_by_one(gw: H2Gateway) -> None:
    """100 held calls, then 400 more in batches of 50 (500 streams opened: the rapid-reset
    ratio is judged): each one past the limit gets RST_STREAM REFUSED_STREAM (which gRPC
    clients retry), and the connection is not ended."""
    conn = RawH2(gw.port)
    make = _calls(conn, 50)
    # Each held call its own rate-limit bucket: the shared one would end some at once.
    held = [("x-rl-tenant", f"held-{time.monotonic_ns()}-{sid}") for sid in range(1, 200, 2)]
    conn.send(b"".join(
        conn.headers(sid, "POST", COLLECT, False, extra=[*GRPC_HEADERS, tenant])
        for sid, tenant in zip(range(1, 200, 2), held, strict=True)
    ))  # fmt: skip
    refused: set[int] = set()
    for i in range(2, 10):
        conn.send(make(i))
        batch, goaway = refused_streams(conn, 3.0, expect=50)
        assert goaway is None, f"GOAWAY {goaway.error_code} after {len(refused)} refusals"
        refused |= batch
    late = next((f for f in conn.frames(0.5) if isinstance(f, GoAwayFrame)), None)
    conn.close()
    assert refused == set(range(201, 1001, 2)), len(refused)
    assert late is None, late


def _message(sid: int, prompt: str) -> bytes:
    """One request message on `sid`, with the client's half-close."""
    return _part(sid, _framed(prompt), True)


def _framed(prompt: str) -> bytes:
    """A request message with its gRPC prefix (uncompressed, its length)."""
    msg = pb2.InferRequest(prompt=prompt).SerializeToString()
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


def _part(sid: int, data: bytes, end: bool) -> bytes:
    """A DATA frame of `data` on `sid`, with the client's half-close when `end`."""
    f = DataFrame(sid)
    f.data = data
    f.flags = {"END_STREAM"} if end else set()  # type: ignore[assignment]
    return f.serialize()


def _status(conn: RawH2, dec: Decoder, sid: int) -> bytes:
    """The grpc-status of the call on `sid` (its trailers), read within 5 s."""
    for f in conn.frames(5.0):
        if isinstance(f, HeadersFrame):
            fields = dict(dec.decode(f.data, raw=True))  # every block: the table in step
            if f.stream_id == sid and "END_STREAM" in f.flags:
                return bytes(fields[b"grpc-status"])
    raise AssertionError(f"no trailers on stream {sid}")


def test_held_calls_open_no_upstream_call_until_their_first_message(
    gw: H2Gateway, backend: Backend
) -> None:
    """Stream exhaustion: client-streaming calls held open without a message take nothing
    upstream; one that sends its message later is served (the call opens then);
    `limits.grpc_first_data_wait_s` (1 s) later the rest are forwarded without one (a method
    whose server speaks first)."""

    def collects() -> int:
        return int(backend.stats()["requests"].get("grpc Collect", 0))

    before = collects()
    conn = RawH2(gw.port)
    extra = [*GRPC_HEADERS, ("x-rl-tenant", "held")]
    held = b"".join(
        conn.headers(sid, "POST", COLLECT, False, extra=extra) for sid in range(1, 20, 2)
    )
    conn.send(held + conn.headers(21, "POST", COLLECT, False, extra=extra) + _message(21, "a"))
    dec = Decoder()
    assert _status(conn, dec, 21) == b"0"
    assert collects() == before + 1  # the ten held calls, opened first, are not upstream
    conn.send(_message(1, "b"))  # one of them sends its message
    assert _status(conn, dec, 1) == b"0"
    assert collects() == before + 2
    wait_until(collects, ok=lambda n: n == before + 11, what="held calls forwarded after 1 s")
    conn.close()


def test_a_call_whose_messages_come_later_streams_through(gw: H2Gateway) -> None:
    """A client-streaming call whose first message comes well after its headers is served, and a
    bidi call is answered message by message (each reply before the next request is sent)."""

    def late() -> Iterator[Any]:
        time.sleep(0.3)
        yield pb2.InferRequest(prompt="late ")
        yield pb2.InferRequest(prompt="reply")

    md = (("x-rl-tenant", "streams"),)
    with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
        stub = pb2_grpc.InferenceStub(ch)
        assert stub.Collect(late(), metadata=md, timeout=5).text == "late reply"
        sent: queue.Queue[Any] = queue.Queue()
        replies = stub.Chat(iter(sent.get, None), metadata=md, timeout=5)
        for word in ("one", "two", "three"):
            sent.put(pb2.InferRequest(prompt=word))
            assert next(replies).text == word  # before the next message is sent
        sent.put(None)
        assert list(replies) == []


def test_memory_after_the_table_is_bounded(gw: H2Gateway) -> None:
    rss = gw.rss_kb()
    for _ in range(3):
        for name in ("continuation", "ping_never_read", "rapid_reset"):
            _, make, pause = ATTACKS[name]
            conn = RawH2(gw.port)
            flood(conn, make(conn), pause)
            conn.close()
    time.sleep(0.5)  # a settle time, not an event: see test_h2_attacks's memory test
    assert gw.rss_kb() - rss < 20 * 1024
    with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
        reply = pb2_grpc.InferenceStub(ch).Infer(pb2.InferRequest(prompt="x"), timeout=5)
        assert reply.usage.total_tokens > 0


def test_a_unary_message_not_in_within_body_read_s_is_deadline_exceeded(
    backend: Backend, tmp_path: Path
) -> None:
    """A unary call whose message does not all come within `timeouts.body_read_s` (0.5 s here)
    is answered DEADLINE_EXCEEDED and never forwarded; one whose message comes in two parts
    within it, on the same connection, is served."""
    port, admin = free_port(), free_port()
    path = tmp_path / "policy.yaml"
    text = policy_text(backend, "h2", port, admin)
    slow = text.replace(
        "timeouts: {first_byte_s: 5,", "timeouts: {body_read_s: 0.5, first_byte_s: 5,"
    )
    assert slow != text
    path.write_text(slow)
    proc = Proc(
        ["serve", "--policy", str(path)], tmp_path / "gateway.log", env={SECRET_ENV: "s" * 32}
    )
    wait_ready(admin, proc)
    try:

        def infers() -> int:
            return int(backend.stats()["requests"].get("grpc Infer", 0))

        before = infers()
        framed = _framed("in two parts")
        conn = RawH2(port)
        extra = [*GRPC_HEADERS, ("x-rl-tenant", "body-read")]
        t0 = time.monotonic()
        conn.send(conn.headers(1, "POST", INFER, False, extra=extra) + _part(1, framed[:7], False))
        conn.send(conn.headers(3, "POST", INFER, False, extra=extra) + _part(3, framed[:7], False))
        time.sleep(0.2)
        conn.send(_part(3, framed[7:], True))  # the rest of call 3's message, in time
        dec = Decoder()
        answers: dict[int, dict[bytes, bytes]] = {}
        for f in conn.frames(5.0):
            if isinstance(f, HeadersFrame):
                fields = dict(dec.decode(f.data, raw=True))  # every block: the table in step
                if "END_STREAM" in f.flags:
                    answers[f.stream_id] = fields
                    if f.stream_id == 1:
                        elapsed = time.monotonic() - t0
            if len(answers) == 2:
                break
        conn.close()
        assert answers[3][b"grpc-status"] == b"0", answers[3]
        assert answers[1][b"grpc-status"] == b"4", answers[1]  # DEADLINE_EXCEEDED
        assert answers[1][b"grpc-message"] == b"request message not received in time"
        assert 0.45 <= elapsed < 2.0, elapsed
        assert infers() == before + 1  # call 3 only
    finally:
        assert proc.stop() == 0, proc.output()
