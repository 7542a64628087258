"""The engine-neutral request lifecycle (one per process, shared by every engine).

`HttpForward.serve(exchange)` runs one HTTP request from admission to finish: header bounds,
path safety, the chain, the body phase, the upstream call through the pool, the response phase
(status, usage, SSE events) and the bookkeeping. Engines (`gateway.adapters`) only move bytes
through the `Exchange` interface. The gRPC handler uses the same failure table
(`failures.py`), outcomes and verdicts. Deadlines (total, body, client stall) are one coarse
ticker (`deadlines.py`).
"""

from __future__ import annotations

from gateway.forward.exchange import BodyTooLarge, Exchange
from gateway.forward.http import HttpForward

__all__ = ["BodyTooLarge", "Exchange", "HttpForward"]
