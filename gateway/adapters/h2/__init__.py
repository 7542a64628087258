"""Sluice's HTTP/2 engine over python-hyper `h2` (`listeners.grpc.engine: h2`, the default, and
HTTP/2 on the HTTP listener): `conn` a connection (with its end: GOAWAYs, drain, timer),
`guard` the frame-level limits h2 leaves to its embedder, `stream` one stream, `server` the
connections of one listener, `exchange` an HTTP route's stream as an `Exchange`, `grpc` and
`grpc_server` the gRPC service on it.

What it offers: `serve_h2` (take over a connection the native engine accepted, after `PREFACE`
or ALPN `h2`), `H2Server` with `H2HttpHandler` (the HTTP listener's HTTP/2 side) and
`start_h2_grpc` (the gRPC listener).
"""

from __future__ import annotations

from gateway.adapters.h2.exchange import H2HttpHandler
from gateway.adapters.h2.grpc_server import H2GrpcServer, start_h2_grpc
from gateway.adapters.h2.guard import PREFACE
from gateway.adapters.h2.server import H2Server, serve_h2

__all__ = ["PREFACE", "H2GrpcServer", "H2HttpHandler", "H2Server", "serve_h2", "start_h2_grpc"]
