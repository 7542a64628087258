"""Ingress engines: they move bytes between the wire and the engine-neutral request lifecycle
(`gateway.forward`) and hold no request logic of their own.

- native HTTP/1.1 (the default): `h1_server` (listener), `h1` (connection: asyncio.Protocol +
  httptools), `h1_exchange` (one request as an `Exchange`), `h1_messages` (parsed requests,
  canned answers);
- aiohttp's HTTP/1.1 server: `http` (listener, and `start_http` for either engine),
  `http_exchange`;
- gRPC on grpc.aio: `grpc` (the server and its generic handler for any method) and the
  `grpc_*` modules it uses.
"""

from __future__ import annotations
