"""The grpc.aio gRPC engine (`listeners.grpc.engine: grpcio`): one generic handler for every
`/pkg.Service/Method`, raw bytes both ways. `server` binds it, `exchange` is a call as a
`GrpcExchange`, `calls` counts calls between handler lookup and start.
"""

from __future__ import annotations

from gateway.adapters.grpcio.server import server_options, start_grpcio

__all__ = ["server_options", "start_grpcio"]
