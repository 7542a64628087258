"""The HTTP/2 floor row of `sluice bench`: the least an h2c reverse proxy in Python costs here.

    python -m gateway.bench.h2floor --listen 127.0.0.1:PORT --upstream 127.0.0.1:PORT

uvloop, one `asyncio.Protocol` per client connection holding a python-hyper `h2` connection
(server side, header encoding off, h2's header validation and normalisation off: nothing is
checked that a codec need not check), HTTP/2 with prior knowledge (h2c). Each stream's request,
once its END_STREAM arrived, goes in a task of its own (as the HTTP/1.1 floor's: what a proxy
with an `await` in its request path pays) to an idle keep-alive upstream connection of that
client connection (a new one when all are busy), its head rebuilt as HTTP/1.1 (Host set,
Content-Length from the body); the response is parsed with httptools as it arrives and relayed
as HEADERS, DATA and END_STREAM (on the last DATA frame when the end came in the same read),
within the stream's send window. Request bodies are acknowledged as they arrive. One write per
read on either side. No policy, no logging, no metrics, no timeouts, nothing bounded: a floor,
not for production. `gateway.bench.floor` is the HTTP/1.1 floor.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import h2.events as ev
import httptools
import uvloop
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.exceptions import H2Error

# Response header names HTTP/2 does not carry (RFC 9113 §8.2.2).
_HOP = frozenset((b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te"))


class _Upstream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the upstream: relays a response to its stream."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sid = 0  # the stream whose response this connection carries
        self.done: asyncio.Future[None] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.complete = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        client = self.client
        if self.body:
            client.send_body(self.sid, b"".join(self.body), self.complete)
            self.body.clear()
        elif self.complete:
            client.send_body(self.sid, b"", True)
        client.flush()
        if self.complete:
            self.complete = False
            done, self.done = self.done, None
            if done is not None and not done.done():
                done.set_result(None)

    def on_message_begin(self) -> None:
        self.headers = [(b":status", b"")]

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n not in _HOP:
            self.headers.append((n, value))

    def on_headers_complete(self) -> None:
        self.headers[0] = (b":status", b"%d" % self.parser.get_status_code())
        self.client.send_headers(self.sid, self.headers)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.upstream_lost(self)
        done, self.done = self.done, None
        if done is not None and not done.done():
            done.set_exception(ConnectionError("upstream closed"))


class _Client(asyncio.Protocol):
    """One client connection: h2's state, the streams' requests, the idle upstream connections."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream_addr = upstream
        self.loop = asyncio.get_running_loop()
        self.host = f"{upstream[0]}:{upstream[1]}".encode()
        self.h2 = H2Connection(
            H2Configuration(
                client_side=False,
                header_encoding=None,
                validate_inbound_headers=False,
                normalize_inbound_headers=False,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
            )
        )
        self.transport: asyncio.Transport | None = None
        self.requests: dict[int, tuple[bytes, list[bytes]]] = {}  # sid → (head, body parts)
        self.unsent: dict[int, tuple[bytes, bool]] = {}  # body held back by the send window
        self.idle: list[_Upstream] = []
        self.ups: set[_Upstream] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.h2.initiate_connection()
        self.flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except H2Error:
            self.flush()
            if self.transport is not None:
                self.transport.close()
            return
        for e in events:
            t = type(e)
            if t is ev.RequestReceived:
                self._head(cast("ev.RequestReceived", e))
            elif t is ev.DataReceived:
                d = cast("ev.DataReceived", e)
                sid = d.stream_id or 0
                req = self.requests.get(sid)
                if req is not None and d.data:
                    req[1].append(d.data)
                self.h2.acknowledge_received_data(d.flow_controlled_length or 0, sid)
            elif t is ev.StreamEnded:
                sid = cast("ev.StreamEnded", e).stream_id or 0
                req = self.requests.pop(sid, None)
                if req is not None:
                    self.loop.create_task(self._serve(sid, req))
            elif t is ev.WindowUpdated or t is ev.RemoteSettingsChanged:
                for sid in list(self.unsent):
                    body, end = self.unsent.pop(sid)
                    self.send_body(sid, body, end)
            elif t is ev.StreamReset:
                sid = cast("ev.StreamReset", e).stream_id or 0
                self.requests.pop(sid, None)
                self.unsent.pop(sid, None)
            elif t is ev.ConnectionTerminated and self.transport is not None:
                self.transport.close()
        self.flush()

    def _head(self, e: ev.RequestReceived) -> None:
        method = path = b""
        lines: list[bytes] = []
        for n, v in e.headers or ():
            if n[:1] == b":":
                if n == b":method":
                    method = v
                elif n == b":path":
                    path = v
            elif n != b"content-length" and n != b"host":
                lines.append(b"%b: %b\r\n" % (n, v))
        head = b"%b %b HTTP/1.1\r\nhost: %b\r\n%b" % (method, path, self.host, b"".join(lines))
        req: tuple[bytes, list[bytes]] = (head, [])
        if e.stream_ended is not None:
            self.loop.create_task(self._serve(e.stream_id or 0, req))
        else:
            self.requests[e.stream_id or 0] = req

    async def _serve(self, sid: int, req: tuple[bytes, list[bytes]]) -> None:
        head, parts = req
        body = b"".join(parts)
        up = self.idle.pop() if self.idle else await self._connect()
        up.sid = sid
        up.done = done = self.loop.create_future()
        assert up.transport is not None
        up.transport.write(b"%bcontent-length: %d\r\n\r\n%b" % (head, len(body), body))
        try:
            await done
        except ConnectionError:
            return
        self.idle.append(up)

    async def _connect(self) -> _Upstream:
        _, up = await self.loop.create_connection(lambda: _Upstream(self), *self.upstream_addr)
        self.ups.add(up)
        return up

    def send_headers(self, sid: int, headers: list[tuple[bytes, bytes]]) -> None:
        try:
            self.h2.send_headers(sid, headers)
        except H2Error:
            pass  # the client reset the stream

    def send_body(self, sid: int, body: bytes, end: bool) -> None:
        """DATA frames within the send windows; the rest waits for a WINDOW_UPDATE."""
        h2c = self.h2
        try:
            while True:
                room = min(h2c.local_flow_control_window(sid), h2c.max_outbound_frame_size)
                if len(body) <= room:
                    h2c.send_data(sid, body, end_stream=end)
                    return
                if room <= 0:
                    self.unsent[sid] = (body, end)
                    return
                h2c.send_data(sid, body[:room])
                body = body[room:]
        except H2Error:
            pass  # the client reset the stream

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def upstream_lost(self, up: _Upstream) -> None:
        self.ups.discard(up)
        if up in self.idle:
            self.idle.remove(up)

    def connection_lost(self, exc: Exception | None) -> None:
        for up in list(self.ups):
            if up.transport is not None:
                up.transport.close()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _serve(listen: tuple[str, int], upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream), *listen, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, type=_addr, help="host:port to serve (h2c)")
    parser.add_argument("--upstream", required=True, type=_addr, help="host:port to forward to")
    args = parser.parse_args()
    uvloop.run(_serve(args.listen, args.upstream))


if __name__ == "__main__":
    main()
