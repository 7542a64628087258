"""The TLS floor of `tests.bench.bench_tls`: the least a server on Sluice's TLS stack costs a
connection here.

    python -m tests.bench.tls_floor --listen 127.0.0.1:PORT --cert CHAIN --key KEY

uvloop's TLS transport (OpenSSL through Python's `ssl` over memory BIOs, as Sluice's listeners
use it) with the context Sluice's listener builds (`gateway.tls.material.build_context`: the
same protocols, options, ALPN and one session ticket per full handshake). Each connection's
first request head is answered from memory (`GET /v1/models`'s body) and the connection closed,
as the storm's `openssl s_time` clients ask: no HTTP parser, no proxying, no policy. Prints
`ready` once listening. Not for production: nothing here is bounded.
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop

from gateway.bench.procs import MODELS_JSON
from gateway.policy.base import ListenerTls
from gateway.tls.listener import ALPN
from gateway.tls.material import build_context

_BODY = MODELS_JSON.encode()
ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"connection: close\r\n\r\n%b" % (len(_BODY), _BODY)
)


class _Conn(asyncio.Protocol):
    """Answers the first request head and closes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.head = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.head += data
        if b"\r\n\r\n" in self.head and self.transport is not None:
            self.transport.write(ANSWER)
            self.transport.close()
            self.transport = None


async def _serve(host: str, port: int, cert: str, key: str) -> None:
    ctx = build_context(ListenerTls(cert=cert, key=key), ALPN["http"])  # the HTTP listener's
    server = await asyncio.get_running_loop().create_server(
        _Conn, host, port, ssl=ctx, backlog=1024
    )
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="host:port to serve")
    parser.add_argument("--cert", required=True, help="PEM certificate chain")
    parser.add_argument("--key", required=True, help="PEM key of --cert")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    uvloop.run(_serve(host, int(port), args.cert, args.key))


if __name__ == "__main__":
    main()
