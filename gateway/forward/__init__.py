"""The engine-neutral request lifecycles, one per protocol family (one each per listener).

`HttpForward.serve(exchange)` (http.py) runs one HTTP request from admission to finish: header
bounds, path safety, the chain, the body phase, the upstream call through the pool, the response
phase (relay.py: status, usage, SSE events). `GrpcForward.serve(exchange, request)` (grpc.py)
runs one gRPC call: the chain, the upstream call on a pooled channel, retries, messages both
ways, the TRAILERS event and the status. Both begin and finish through `lifecycle.py` (snapshot,
context, in-flight count, on_response, metrics, traffic) and share the failure table
(`failures.py`) and the deadline ticker (`deadlines.py`). Engines (`gateway.adapters`) only move
bytes, through `Exchange` (exchange.py) and `GrpcExchange` (grpc_exchange.py).
"""

from __future__ import annotations

from gateway.forward.exchange import BodyTooLarge, Exchange
from gateway.forward.http import HttpForward

__all__ = ["BodyTooLarge", "Exchange", "HttpForward"]
