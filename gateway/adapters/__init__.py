"""Ingress engines: they move bytes between the wire and the engine-neutral request lifecycle
(`gateway.forward`) and hold no request logic of their own. One folder per engine, named as the
policy names it; each folder's `__init__` is its face, what it offers the rest of Sluice, and no
module imports across engine folders except through a face.

- `native/`: Sluice's HTTP/1.1 engine (the HTTP listener's default);
- `aiohttp/`: aiohttp's HTTP/1.1 server;
- `h2/`: Sluice's HTTP/2 engine and its gRPC service (the gRPC listener's default);
- `grpcio/`: grpc.aio's gRPC server;
- `engines.py` chooses the engine of a listener (`start_http`, `start_grpc`); `common.py` holds
  what every HTTP engine writes alike.
"""

from __future__ import annotations
