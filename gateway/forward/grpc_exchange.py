"""`GrpcExchange`: what a gRPC engine offers the call lifecycle for one call, nothing more.

The grpc.aio engine (`gateway.adapters.grpcio.exchange`) implements it, and so does any other gRPC
engine (Sluice's own over h2); everything that is not moving messages, metadata and statuses
(admission, the chain, the upstream call, retries, deadlines, the failure table, events, the
finish) is `gateway.forward.grpc`, written once.

How an engine drives a call: it builds the exchange (`request_info` turns the client's metadata
into what the filters see), then runs `GrpcForward.serve(exchange, request)` in the call's own
task, with the request message of a method it serves as unary, or None for a streaming one.
It cancels that task when the client cancels the call or goes away (RST_STREAM, connection
lost): the lifecycle then ends the upstream call and records the call as cancelled, or as a
deadline when `time_remaining()` is used up. A call the lifecycle returns from has had `end`.

Status codes are gRPC's numbers (`gateway.core.verdict.GRPC_*`); metadata are (name, value)
pairs, str values, bytes for `-bin` names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gateway.core.request import RequestInfo, Wire

Metadata = Sequence[tuple[str, str | bytes]]


class MessageRefused(Exception):
    """Raised by `read()` for a request message the engine will not take (over the size limit,
    a compressed one that does not inflate): the lifecycle records `code`, ends the upstream
    call and lets the engine's task end; the engine answers the client with `code`."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class GrpcExchange(Protocol):
    info: RequestInfo  # path: the full method name; headers: the text metadata; peer
    metadata: Metadata  # as the client sent it (binary values too), for the upstream call

    def time_remaining(self) -> float | None:
        """Seconds left of the client's deadline; None when it set none."""
        ...

    async def read(self) -> bytes | None:
        """The next request message of a streaming call; None once the client half-closed."""
        ...

    async def send_initial_metadata(self, md: Metadata) -> None:
        """The response's initial metadata (at most once, before the first message)."""
        ...

    async def write(self, message: bytes) -> None:
        """One response message; returns once the client's window has room (may wait: the
        caller bounds that wait). A unary call's one response is written this way too."""
        ...

    def end(self, code: int, details: str, trailing: Metadata) -> None:
        """End the call: status, details and trailing metadata, after whatever was written
        (once per call; never waits)."""
        ...


def request_info(method: str, md: Metadata, peer: str, client_cert: str = "") -> RequestInfo:
    """The call as the filters see it: a POST to the method's path with the text metadata as
    headers. Repeated keys are joined as HTTP does (a filter sees both `authorization` entries,
    not the last one); binary (`-bin`) values are left out. `client_cert`: the verified client
    certificate's identity ("" without mTLS)."""
    headers = {k: v for k, v in md if type(v) is str}
    if len(headers) != len(md):  # repeated keys or binary values
        headers = {}
        for k, v in md:
            if type(v) is str:
                headers[k] = v if k not in headers else headers[k] + ", " + v
    return RequestInfo(Wire.GRPC, "POST", method, headers, peer, "", None, client_cert)
