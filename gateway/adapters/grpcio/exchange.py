"""The grpc.aio engine's side of a call: its `ServicerContext` as a `GrpcExchange`, and the two
behaviours the generic handler registers (unary, stream-stream), which hand the call to
`gateway.forward.grpc.GrpcForward`. Translation only: metadata in, messages both ways, initial
and trailing metadata, numeric status codes to `grpc.StatusCode`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from gateway.forward.grpc_exchange import Metadata, request_info
from gateway.tls.material import grpc_identity

if TYPE_CHECKING:
    from gateway.adapters.grpcio.calls import CallAccounting
    from gateway.forward.grpc import GrpcForward

Context = grpc.aio.ServicerContext[bytes, bytes]
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs

CODES: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


class AioExchange:
    """A streaming call: messages are read and written through the context as they come."""

    __slots__ = ("info", "metadata", "_context")

    def __init__(self, method: str, context: Context, client_certs: bool = False) -> None:
        md: Metadata = context.invocation_metadata() or ()  # type: ignore[assignment]
        self.metadata = md
        cert = grpc_identity(context.auth_context()) if client_certs else ""
        self.info = request_info(method, md, context.peer(), cert)
        self._context = context

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    async def read(self) -> bytes | None:
        msg = await self._context.read()
        return None if msg is EOF else msg

    async def send_initial_metadata(self, md: Metadata) -> None:
        await self._context.send_initial_metadata(md)

    async def write(self, message: bytes) -> None:
        await self._context.write(message)

    def end(self, code: int, details: str, trailing: Metadata) -> None:
        # grpc.aio sends the status when the handler returns; OK is its default.
        context = self._context
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        if code:
            context.set_code(CODES.get(code, grpc.StatusCode.UNKNOWN))
        if details:
            context.set_details(details)


class AioUnaryExchange(AioExchange):
    """A unary call: the request came as the handler's argument, and grpc.aio sends the one
    response the handler returns."""

    __slots__ = ("response",)

    def __init__(self, method: str, context: Context, client_certs: bool = False) -> None:
        super().__init__(method, context, client_certs)
        self.response: bytes | None = None

    async def write(self, message: bytes) -> None:
        self.response = message


# Module-level functions wrapped in functools.partial (not bound methods): grpc checks each
# behaviour with inspect.iscoroutinefunction per call, which is cheap only for plain functions.
async def unary_call(
    forward: GrpcForward,
    calls: CallAccounting,
    client_certs: bool,
    method: str,
    request: bytes,
    context: Context,
) -> bytes | None:
    """The unary behaviour: one request message in, one response message out. `client_certs`:
    the listener verifies client certificates (their identity goes into the request info)."""
    calls.started()
    ex = AioUnaryExchange(method, context, client_certs)
    await forward.serve(ex, request)
    return ex.response


async def stream_call(
    forward: GrpcForward,
    calls: CallAccounting,
    client_certs: bool,
    method: str,
    request_iterator: AsyncIterator[bytes],
    context: Context,
) -> None:
    """The stream-stream behaviour (carries unary-stream and stream-unary calls too): messages
    are read from the context, not from `request_iterator`."""
    calls.started()
    await forward.serve(AioExchange(method, context, client_certs), None)
