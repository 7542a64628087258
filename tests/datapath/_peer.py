"""Traffic peers for the datapath tests, run inside a test network namespace with
`ip netns exec NS python tests/datapath/_peer.py MODE ...`; each prints one JSON line.

server   a grpc.aio h2c server: unary Infer echoes the request bytes
grpc     N unary calls over one channel
connect  N parallel TCP connects from --source; how many completed within --timeout
streams  a raw HTTP/2 client (h2) opening N streams from --source; responses seen
         (--metadata-bytes: that much extra metadata, sent as HEADERS + CONTINUATION frames)
rapid    a raw HTTP/2 client doing rapid reset (HEADERS then RST_STREAM) N times from --source
cont     CONTINUATION flood: HEADERS without END_HEADERS, then CONTINUATION frames of --size
         bytes (0: empty ones, many per packet; --split: each frame header cut across two
         segments) for up to --timeout seconds from --source, never reading
ping     PING flood from --source for up to --timeout seconds, -n PINGs per write, never reading
"""

from __future__ import annotations

import argparse
import asyncio
import json
import selectors
import socket
import sys
import time
from typing import Any

METHOD = "/sluice.inference.v1.Inference/Infer"


def _out(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def _server(host: str, port: int) -> None:
    import grpc

    async def infer(request: bytes, context: Any) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "sluice.inference.v1.Inference",
        {"Infer": grpc.unary_unary_rpc_method_handler(infer)},
    )
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    _out({"ready": True})
    await server.wait_for_termination()


async def _grpc(target: str, n: int, size: int) -> None:
    import grpc

    ok, errors = 0, []
    async with grpc.aio.insecure_channel(target, options=[("grpc.enable_retries", 0)]) as ch:
        call = ch.unary_unary(METHOD)
        for _ in range(n):
            try:
                await call(b"x" * size, timeout=3)
                ok += 1
            except grpc.aio.AioRpcError as exc:
                errors.append(str(exc.code()))
    _out({"ok": ok, "errors": errors[:3]})


def _connect(target: str, source: str, n: int, timeout: float) -> None:
    host, port = target.rsplit(":", 1)
    sel = selectors.DefaultSelector()
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.bind((source, 0))
        s.connect_ex((host, int(port)))
        sel.register(s, selectors.EVENT_WRITE)
        socks.append(s)
    done: set[socket.socket] = set()
    deadline = time.monotonic() + timeout
    while len(done) < n and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                done.add(sock)
            sel.unregister(sock)
    for s in socks:
        s.close()
    _out({"ok": len(done)})


def _h2conn(target: str, source: str) -> tuple[socket.socket, Any]:
    import h2.config
    import h2.connection

    host, port = target.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=3, source_address=(source, 0))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    s.sendall(conn.data_to_send())
    return s, conn


def _headers(target: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", target),
        (":path", METHOD),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


def _streams(target: str, source: str, n: int, timeout: float, metadata: int = 0) -> None:
    import h2.events

    s, conn = _h2conn(target, source)
    extra = [(f"x-pad-{i}", "p" * 90) for i in range(metadata // 100)]
    if extra:  # header blocks of several frames: HEADERS + CONTINUATION, as RFC 9113 allows
        conn.max_outbound_frame_size = 4096
    responses = 0
    for _ in range(n):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, _headers(target) + extra)
        conn.send_data(sid, b"\x00\x00\x00\x00\x01x", end_stream=True)
        s.sendall(conn.data_to_send())
        time.sleep(0.002)
    deadline = time.monotonic() + timeout
    s.settimeout(0.2)
    while time.monotonic() < deadline and responses < n:
        try:
            data = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not data:
            break
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.ResponseReceived):
                responses += 1
        pending = conn.data_to_send()
        if pending:
            s.sendall(pending)
    s.close()
    _out({"responses": responses})


def _rapid(target: str, source: str, n: int) -> None:
    from h2.errors import ErrorCodes

    s, conn = _h2conn(target, source)
    s.settimeout(1.0)
    sent, error = 0, None
    try:
        for _ in range(n):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, _headers(target))
            conn.reset_stream(sid, ErrorCodes.CANCEL)
            s.sendall(conn.data_to_send())
            sent += 1
            time.sleep(0.001)
    except OSError as exc:
        error = type(exc).__name__
    # A blocked flow gets no more ACKs: a PING must go unanswered.
    conn.ping(b"12345678")
    pong = False
    try:
        s.sendall(conn.data_to_send())
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and not pong:
            data = s.recv(65536)
            if not data:
                break
            pong = any(type(e).__name__ == "PingAckReceived" for e in conn.receive_data(data))
    except OSError:
        pass
    s.close()
    _out({"sent": sent, "error": error, "pong": pong})


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + sid.to_bytes(4, "big") + payload


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal without indexing, new name, no Huffman (RFC 7541 6.2.2); short strings."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _flood(target: str, source: str, timeout: float, first: bytes, chunks: list[bytes]) -> None:
    """Send `first`, then `chunks` round and round until the socket stalls (a blocked flow gets
    no ACKs), breaks, or `timeout` passes. Never reads."""
    host, port = target.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=3, source_address=(source, 0))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(PREFACE + _frame(0x4, 0, 0, b"") + first)
    s.settimeout(1.0)
    sent, outcome = len(first), "timeout"
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            for chunk in chunks:
                s.sendall(chunk)
                sent += len(chunk)
    except TimeoutError:
        outcome = "stalled"
    except OSError as exc:
        outcome = type(exc).__name__
    _out({"sent": sent, "outcome": outcome, "elapsed": round(time.monotonic() - t0, 3),
          "port": s.getsockname()[1]})  # fmt: skip
    s.close()


def _cont(target: str, source: str, size: int, split: bool, timeout: float) -> None:
    path = b"\x04" + bytes([len(METHOD)]) + METHOD.encode()  # :path, indexed name 4
    block = b"\x83\x86" + path + _literal(b"content-type", b"application/grpc")
    block += _literal(b"te", b"trailers")
    headers = _frame(0x1, 0, 1, block)  # no END_HEADERS
    if size == 0:  # empty CONTINUATION frames, 9 bytes each: hundreds per packet
        chunks = [_frame(0x9, 0, 1, b"") * 1000]
    else:
        one = b"".join(_literal(b"x-f%04d" % i, b"v" * 40) for i in range(size // 50 + 1))
        frame = _frame(0x9, 0, 1, one[:size])
        # --split: the frame header is cut after 4 bytes, in a segment of its own (NODELAY)
        chunks = [frame[:4], frame[4:]] if split else [frame]
    _flood(target, source, timeout, headers, chunks)


def _ping(target: str, source: str, timeout: float, batch: int) -> None:
    _flood(target, source, timeout, b"", [_frame(0x6, 0, 0, b"12345678") * batch])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "mode", choices=["server", "grpc", "connect", "streams", "rapid", "cont", "ping"]
    )
    p.add_argument("--split", action="store_true")
    p.add_argument("--metadata-bytes", type=int, default=0)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--target", default="")
    p.add_argument("--source", default="0.0.0.0")
    p.add_argument("-n", type=int, default=10)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--timeout", type=float, default=1.0)
    a = p.parse_args()
    if a.mode == "server":
        asyncio.run(_server(a.host, a.port))
    elif a.mode == "grpc":
        asyncio.run(_grpc(a.target, a.n, a.size))
    elif a.mode == "connect":
        _connect(a.target, a.source, a.n, a.timeout)
    elif a.mode == "streams":
        _streams(a.target, a.source, a.n, a.timeout, a.metadata_bytes)
    elif a.mode == "cont":
        _cont(a.target, a.source, a.size, a.split, a.timeout)
    elif a.mode == "ping":
        _ping(a.target, a.source, a.timeout, a.n)
    else:
        _rapid(a.target, a.source, a.n)


if __name__ == "__main__":
    sys.exit(main())
