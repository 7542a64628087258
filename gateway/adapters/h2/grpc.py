"""gRPC on Sluice's HTTP/2 engine: one stream (`H2Stream`) of an `H2Conn` as a `GrpcExchange`,
and the stream handler of a gRPC listener that hands each call to
`gateway.forward.grpc.GrpcForward`. Translation only (the gRPC over HTTP/2 wire format,
grpc/grpc doc/PROTOCOL-HTTP2.md):

- request: `:path` is the method; the other headers are the metadata (`-bin` values base64
  decoded, kept as bytes for the upstream call); `grpc-timeout` (≤ 8 digits and a unit H M S m
  u n) is the deadline behind `time_remaining()`: when it passes, the call's task is cancelled
  (the lifecycle records a deadline) and the client gets DEADLINE_EXCEEDED.
- messages: 5-byte prefix (compressed flag, length) read from the stream's DATA; the length is
  checked against `limits.grpc_max_message_bytes` as soon as the prefix is in, before the body is
  buffered (RESOURCE_EXHAUSTED, answered once the client half-closed, what it still sends
  dropped as it comes). The stream's window goes back to the client only as bytes are
  taken (`H2Stream.take`). A compressed message (`grpc-encoding` gzip or deflate) is inflated,
  bounded by the same limit: the upstream is a grpc.aio channel, which takes whole messages.
- response: HEADERS (:status 200, content-type, initial metadata), DATA per message within the
  stream's send window (a write waits for it), and the status as trailers (HEADERS with
  END_STREAM); a call ended before anything was sent is answered trailers-only. `grpc-message`
  is percent-encoded.
- a streaming call reaches the lifecycle (chain, admission, upstream call) at its first DATA
  bytes or half-close, or `limits.grpc_first_data_wait_s` after its HEADERS without either: a
  call held open without a message costs a waiting task, not an upstream call (stream
  exhaustion); a unary call at its whole message, as before.
- a client RST_STREAM (or a lost connection) cancels the call's task (`H2Conn`): the lifecycle
  cancels the upstream call and records a client cancel.
- every stream is recorded: calls ended before the lifecycle had them (reset before their task
  ran, malformed, a unary message over the limit) through `GrpcForward.unserved`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import zlib
from typing import TYPE_CHECKING

from h2.errors import ErrorCodes
from hpack import NeverIndexedHeaderTuple

from gateway.adapters.h2.codec import UNIQUE
from gateway.adapters.h2.stream import H2Stream, StreamConn
from gateway.core.outcome import Outcome
from gateway.core.verdict import (
    GRPC_CANCELLED,
    GRPC_DEADLINE_EXCEEDED,
    GRPC_INTERNAL,
    GRPC_RESOURCE_EXHAUSTED,
    GRPC_UNIMPLEMENTED,
)
from gateway.forward.grpc_exchange import MessageRefused, Metadata, request_info
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.forward.grpc import GrpcForward

log = logging.getLogger("sluice.grpc")

# Seconds per grpc-timeout unit (grpc/grpc doc/PROTOCOL-HTTP2.md, "Timeout").
TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# Headers that are the transport's, not metadata (grpc core leaves them out too).
NOT_METADATA = frozenset({"te", "content-type", "grpc-timeout", "grpc-encoding"})
CONTENT_TYPE = b"application/grpc"
STATUS_200 = ((b":status", b"200"), (b"content-type", CONTENT_TYPE))
DEADLINE_DETAILS = "Deadline Exceeded"  # what grpc core says for a deadline it enforced
INFLATE_WBITS = {"gzip": 31, "deflate": 15}


def parse_timeout(value: str) -> float | None:
    """Seconds of a `grpc-timeout` value, or None when it is malformed (more than 8 digits, an
    unknown unit)."""
    digits, unit = value[:-1], value[-1:]
    scale = TIMEOUT_UNITS.get(unit)
    if scale is None or not 0 < len(digits) <= 8 or not digits.isdigit():
        return None
    return int(digits) * scale


def grpc_message(details: str) -> bytes:
    """`grpc-message`: UTF-8, percent-encoded outside printable ASCII, and `%` itself."""
    raw = details.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def metadata_headers(md: Metadata) -> list[tuple[bytes, bytes]]:
    """Metadata as HTTP/2 header fields: binary values base64 encoded, without padding; a value
    new in every answer (`codec.UNIQUE`: the overhead figure, the request id) as a literal never
    indexed."""
    out: list[tuple[bytes, bytes]] = []
    for k, v in md:
        name = k.encode("latin-1")
        if isinstance(v, bytes):
            out.append((name, base64.b64encode(v).rstrip(b"=")))
        elif name in UNIQUE:
            out.append(NeverIndexedHeaderTuple(name, v.encode("utf-8", "surrogateescape")))
        else:
            out.append((name, v.encode("utf-8", "surrogateescape")))
    return out


class H2GrpcExchange:
    """One gRPC call on one HTTP/2 stream (`gateway.forward.grpc_exchange.GrpcExchange`)."""

    __slots__ = (
        "stream", "conn", "loop", "info", "metadata", "deadline", "limit", "encoding", "buf",
        "head_sent", "ended", "writing", "timeout", "expired", "content_type", "method",
        "refused", "timeout_raw",
    )  # fmt: skip

    def __init__(
        self, stream: H2Stream, conn: StreamConn, loop: asyncio.AbstractEventLoop, limit: int
    ) -> None:
        self.stream = stream
        self.conn = conn
        self.loop = loop
        self.limit = limit
        method = content_type = timeout = encoding = ""
        md: list[tuple[str, str | bytes]] = []
        for n, v in stream.headers:
            k = n.decode("latin-1")
            if k[:1] == ":":
                if k == ":path":
                    method = v.decode("utf-8", "surrogateescape")
                continue
            if k in NOT_METADATA:
                if k == "content-type":
                    content_type = v.decode("latin-1")
                elif k == "grpc-timeout":
                    timeout = v.decode("latin-1")
                elif k == "grpc-encoding":
                    encoding = v.decode("latin-1")
                continue
            if k.endswith("-bin"):
                try:
                    md.append((k, base64.b64decode(v + b"=" * (-len(v) % 4))))
                except (binascii.Error, ValueError):
                    continue  # not base64: dropped, as grpc core does
            else:
                md.append((k, v.decode("utf-8", "surrogateescape")))
        self.method = method
        self.content_type = content_type
        self.encoding = encoding
        self.metadata: Metadata = md
        self.info = request_info(method, md, conn.peer, conn.client_cert)
        self.timeout_raw = timeout
        self.timeout = parse_timeout(timeout) if timeout else None
        self.deadline = loop.time() + self.timeout if self.timeout is not None else None
        self.expired = False  # the client's deadline passed (the task was cancelled for it)
        self.buf = bytearray()
        self.head_sent = False
        self.ended = False
        self.writing = False  # a message is partly written: a status after it would cut it
        self.refused: MessageRefused | None = None  # why read() ended the call

    def refusal(self) -> tuple[int, str] | None:
        """Why this stream cannot be served as a gRPC call (status and details), or None."""
        if not self.content_type.startswith("application/grpc"):
            return GRPC_UNIMPLEMENTED, "not a gRPC request (content-type)"
        if self.timeout_raw and self.timeout is None:
            return GRPC_INTERNAL, "malformed grpc-timeout"
        if self.encoding not in ("", "identity") and self.encoding not in INFLATE_WBITS:
            return GRPC_UNIMPLEMENTED, f"message encoding {self.encoding!r} not supported"
        if self.method[:1] != "/":
            return GRPC_UNIMPLEMENTED, "malformed method path"
        return None

    # --- GrpcExchange ---

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self.loop.time())

    async def read(self) -> bytes | None:
        try:
            return await self.message()
        except MessageRefused as e:  # the lifecycle ends the call (and its upstream call);
            self.refused = e  # the handler answers the client once it half-closed
            raise

    async def send_initial_metadata(self, md: Metadata) -> None:
        if not self.head_sent:
            self.head_sent = True
            try:
                self.conn.send_headers(self.stream, [*STATUS_200, *metadata_headers(md)], False)
            except ConnectionError:  # reset under us: the client cancelled the call
                raise asyncio.CancelledError() from None

    async def write(self, message: bytes) -> None:
        try:
            if not self.head_sent:
                self.head_sent = True
                self.conn.send_headers(self.stream, list(STATUS_200), False)
            self.writing = True
            frame = b"\x00" + len(message).to_bytes(4) + message
            await self.conn.send_data(self.stream, frame, False)
            self.writing = False
        except ConnectionError:  # reset under us: the client cancelled the call
            raise asyncio.CancelledError() from None

    def end(self, code: int, details: str, trailing: Metadata) -> None:
        if self.ended:
            return
        self.ended = True
        stream = self.stream
        if self.writing:  # a message was cut: the client must not take it as whole
            self.conn.reset(stream, ErrorCodes.CANCEL)
            return
        fields = [(b"grpc-status", b"%d" % code)]
        if details:
            fields.append((b"grpc-message", grpc_message(details)))
        fields += metadata_headers(trailing)
        if not self.head_sent:  # trailers-only
            self.head_sent = True
            fields = [*STATUS_200, *fields]
        try:
            self.conn.send_headers(stream, fields, True)
        except ConnectionError:
            pass  # the client is gone: nothing reaches it

    # --- request messages ---

    async def message(self) -> bytes | None:
        """The next whole request message; None once the client half-closed. Raises
        MessageRefused past the size limit (on the prefix), for a cut message or a bad
        compressed one; ConnectionResetError when the stream is gone."""
        stream, buf = self.stream, self.buf
        while True:
            if len(buf) >= 5:
                size = int.from_bytes(buf[1:5])
                if size > self.limit:
                    metrics.REJECTED.labels("grpc_message_too_large", "grpc").inc()
                    buf.clear()
                    raise MessageRefused(  # in grpc core's words, as the grpcio engine answers
                        GRPC_RESOURCE_EXHAUSTED,
                        f"SERVER: Received message larger than max ({size} vs. {self.limit})",
                    )
                if len(buf) >= 5 + size:
                    compressed = buf[0]
                    msg = bytes(buf[5 : 5 + size])
                    del buf[: 5 + size]
                    return self.inflate(msg) if compressed else msg
            if stream.body:
                buf += stream.take()
                continue
            if stream.body_done:
                if buf:
                    raise MessageRefused(GRPC_INTERNAL, "request ended inside a message")
                return None
            if stream.reset:
                raise ConnectionResetError("stream reset")
            await stream.wait()

    async def drain_request(self, timeout: float) -> None:
        """Drop what the client still sends until it half-closes (the window keeps moving,
        nothing is buffered), or `timeout`: a call refused for a message's size is answered
        after it, because a grpcio client still writing its requests when the status arrives
        reports INTERNAL instead of the status (seen in the differential test; the grpcio
        engine's answer reaches it whole)."""
        stream = self.stream
        try:
            async with asyncio.timeout(timeout):
                while not stream.body_done:
                    if stream.body:
                        stream.take()
                    elif stream.reset:
                        return
                    else:
                        await stream.wait()
        except (TimeoutError, ConnectionError):
            pass

    def inflate(self, msg: bytes) -> bytes:
        wbits = INFLATE_WBITS.get(self.encoding)
        if wbits is None:
            raise MessageRefused(GRPC_INTERNAL, "compressed message without grpc-encoding")
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(msg, self.limit + 1)
        except zlib.error:
            raise MessageRefused(GRPC_INTERNAL, "message does not decompress") from None
        if len(out) > self.limit:
            raise MessageRefused(
                GRPC_RESOURCE_EXHAUSTED, f"Received message larger than max (> {self.limit})"
            )
        return out


class H2GrpcHandler:
    """Serves the streams of a gRPC listener on the HTTP/2 engine: one task and one exchange
    per call (`gateway.adapters.h2.server.StreamHandler`). Methods in `unary` are read whole
    and served by the lifecycle's unary path (one upstream unary call: the cheaper one), the
    rest as streams, handed to the lifecycle at their first DATA bytes or half-close, or after
    `first_data_s` without either (`limits.grpc_first_data_wait_s`): a call held open without
    a message takes no admission and opens no upstream call."""

    def __init__(
        self, forward: GrpcForward, limit: int, body_read_s: float, first_data_s: float = 0.0
    ) -> None:
        self.forward = forward
        self.limit = limit
        self.body_read_s = body_read_s
        self.first_data_s = first_data_s
        self.unary: frozenset[str] = frozenset()

    def set_unary(self, methods: frozenset[str]) -> None:
        self.unary = methods

    def start(self, conn: StreamConn, stream: H2Stream) -> asyncio.Task[None]:
        return self.forward.loop.create_task(self._run(conn, stream))

    async def _run(self, conn: StreamConn, stream: H2Stream) -> None:
        stream.started = True
        ex: H2GrpcExchange | None = None
        timer: asyncio.TimerHandle | None = None
        served = False  # the lifecycle has the call (it records how it ends)
        forward = self.forward
        try:
            ex = H2GrpcExchange(stream, conn, forward.loop, self.limit)
            if stream.reset:  # reset before its task ran: recorded, never forwarded
                await forward.unserved(ex, Outcome.CLIENT_CANCELLED, GRPC_CANCELLED)
                return
            refused = ex.refusal()
            if refused is not None:
                metrics.REJECTED.labels("bad_request", "grpc").inc()
                await forward.unserved(ex, Outcome.BAD_REQUEST, *refused)
                return
            if ex.deadline is not None:
                timer = forward.loop.call_at(ex.deadline, _expire, ex)
            if ex.method in self.unary:
                request: bytes | None = await self._unary_request(ex)
            else:
                request = None
                if self.first_data_s > 0 and not (stream.body or stream.body_done):
                    await _first_data(stream, self.first_data_s)
            served = True
            await forward.serve(ex, request)
        except MessageRefused as e:  # the request of a unary call, before it was served
            assert ex is not None
            if e.code == GRPC_RESOURCE_EXHAUSTED:
                await ex.drain_request(self.body_read_s)
            await forward.unserved(ex, Outcome.BAD_REQUEST, e.code, e.details)
        except (asyncio.CancelledError, ConnectionError):
            if ex is None:
                pass
            elif not served:  # the client's deadline or reset came while its request did
                if ex.expired:
                    await forward.unserved(
                        ex, Outcome.DEADLINE, GRPC_DEADLINE_EXCEEDED, DEADLINE_DETAILS
                    )
                else:
                    await forward.unserved(ex, Outcome.CLIENT_CANCELLED, GRPC_CANCELLED)
            elif ex.expired:  # recorded by the lifecycle as a deadline: the client's answer
                ex.end(GRPC_DEADLINE_EXCEEDED, DEADLINE_DETAILS, ())
            elif ex.refused is not None and not stream.reset:
                await ex.drain_request(self.body_read_s)
                ex.end(ex.refused.code, ex.refused.details, ())
        except Exception:  # a bug of ours: log it, reset this stream, keep serving others
            log.exception("gRPC call on HTTP/2 failed")
        finally:
            if timer is not None:
                timer.cancel()
            conn.stream_done(stream)  # a stream not ended cleanly is reset

    async def _unary_request(self, ex: H2GrpcExchange) -> bytes:
        """The one request message of a unary call, read to the client's half-close within
        `timeouts.body_read_s` (on the forward's coarse deadlines, as an HTTP body's read: an
        `asyncio.timeout` costs a timer and ~5 Python calls a call). Raises MessageRefused when
        it cannot be had."""
        if ex.stream.body_done:  # all of it came with the head: nothing to wait for
            request = await ex.message()
            extra = await ex.message() if request is not None else None
        else:
            deadlines = self.forward.deadlines
            task = ex.stream.task
            assert task is not None  # (this coroutine is its task)
            deadlines.start(task, self.body_read_s)
            try:
                request = await ex.message()
                extra = await ex.message() if request is not None else None
            except asyncio.CancelledError:
                if deadlines.expired(task) is None:  # the client's reset or deadline
                    raise
                raise MessageRefused(
                    GRPC_DEADLINE_EXCEEDED, "request message not received in time"
                ) from None
            finally:
                deadlines.stop(task)
        if request is None or extra is not None:
            raise MessageRefused(
                GRPC_UNIMPLEMENTED, "a unary call takes exactly one request message"
            )
        return request


async def _first_data(stream: H2Stream, seconds: float) -> None:
    """Until the stream's first DATA bytes, its half-close, or `seconds` (then the call goes
    on without them: a method whose server speaks first). An attacker holding streams open
    without a message (stream exhaustion) so costs a waiting task each, not a chain run and an
    upstream call opened and cancelled per stream. Raises ConnectionResetError when the stream
    is gone."""
    try:
        async with asyncio.timeout(seconds):
            while not (stream.body or stream.body_done):
                await stream.wait()
    except TimeoutError:
        pass


def _expire(ex: H2GrpcExchange) -> None:
    """The client's deadline passed: cancel the call (the lifecycle counts a deadline)."""
    task = ex.stream.task
    if task is not None and not task.done() and not ex.ended:
        ex.expired = True
        task.cancel()
