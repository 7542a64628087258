"""The floor row of `sluice bench`: the least an HTTP/1.1 reverse proxy in Python costs here.

    python -m gateway.bench.floor --listen 127.0.0.1:PORT --upstream 127.0.0.1:PORT [--callbacks]

uvloop, one `asyncio.Protocol` per client connection with its own keep-alive upstream
connection, httptools on both sides; no policy, no logging, no metrics, no timeouts. A request
is parsed, its head rebuilt (Host set, Connection dropped), and a task per request (the floor as
the hot-path issue defines it: what any Python proxy with an `await` in its request path pays)
sends it with its body and waits for the response's end; the response is parsed to find that
end and relayed as it arrives. `--callbacks`: no task, the request is sent from the parser's
callback (a reference row: the least a Python proxy can do here, with nothing that can wait).
One request at a time per connection (wrk does not pipeline). Not for production: nothing here
is bounded.
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import uvloop


class _Upstream(asyncio.Protocol):
    """The upstream side: relays the response bytes, tells the client side when it ended."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        ct = self.client.transport
        if ct is not None:
            ct.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.client.response_done()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client.transport is not None:
            self.client.transport.close()


class _Client(asyncio.Protocol):
    """The client side: parses requests and writes each to the upstream connection."""

    def __init__(self, upstream: tuple[str, int], task_per_request: bool) -> None:
        self.upstream_addr = upstream
        self.task_per_request = task_per_request
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] | None = None  # the response in flight has ended
        self.host = f"{upstream[0]}:{upstream[1]}".encode()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.up: _Upstream | None = None
        self.pending: list[bytes] = []  # written before the upstream connection is up
        self.url = b""
        self.headers: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, up = await loop.create_connection(lambda: _Upstream(self), *self.upstream_addr)
        self.up = up
        for data in self.pending:
            self._send(data)
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        ln = name.lower()
        if ln not in (b"host", b"connection", b"keep-alive", b"content-length"):
            self.headers.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        head = b"%b %b HTTP/1.1\r\nhost: %b\r\n%bcontent-length: %d\r\n\r\n" % (
            self.parser.get_method(),
            self.url,
            self.host,
            b"".join(self.headers),
            len(body),
        )
        if self.task_per_request:
            self.loop.create_task(self._serve(head + body))
        else:
            self._send(head + body)

    async def _serve(self, data: bytes) -> None:
        self.done = done = self.loop.create_future()
        self._send(data)
        await done
        self.done = None
        if not self.parser.should_keep_alive() and self.transport is not None:
            self.transport.close()

    def _send(self, data: bytes) -> None:
        if self.up is None or self.up.transport is None:
            self.pending.append(data)
        else:
            self.up.transport.write(data)

    def response_done(self) -> None:
        if self.done is not None:
            if not self.done.done():
                self.done.set_result(None)
        elif not self.parser.should_keep_alive() and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()
        if self.done is not None and not self.done.done():
            self.done.cancel()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _serve(listen: tuple[str, int], upstream: tuple[str, int], task: bool) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream, task), *listen, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, type=_addr, help="host:port to serve")
    parser.add_argument("--upstream", required=True, type=_addr, help="host:port to forward to")
    parser.add_argument(
        "--callbacks", action="store_true", help="no task per request (the reference row)"
    )
    args = parser.parse_args()
    uvloop.run(_serve(args.listen, args.upstream, not args.callbacks))


if __name__ == "__main__":
    main()
