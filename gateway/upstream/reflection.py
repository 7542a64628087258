"""Learn which methods of a gRPC backend are unary, from its server reflection service.

Sluice proxies gRPC as raw bytes and needs no protos; the only thing it wants to know is which
methods are unary, because a unary handler costs about a third less than the stream-stream one.
We speak the reflection protocol raw (grpcio-reflection's generated messages, no client
library) and read the `client_streaming`/`server_streaming` flags of the FileDescriptorProtos.
A deadline bounds it; failures raise, and `ChannelPool.discover_unary` turns them into an empty
set (logged once per address).
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection_pb2

# v1 and v1alpha carry the same messages on the wire; older servers only speak v1alpha.
REFLECTION_METHODS = (
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
)
_Request = reflection_pb2.ServerReflectionRequest
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs


def unary_methods_of(files: list[bytes]) -> set[str]:
    """`/pkg.Service/Method` of every unary method declared in serialized FileDescriptorProtos."""
    out: set[str] = set()
    for raw in files:
        fdp = descriptor_pb2.FileDescriptorProto.FromString(raw)
        prefix = f"{fdp.package}." if fdp.package else ""
        for svc in fdp.service:
            for m in svc.method:
                if not m.client_streaming and not m.server_streaming:
                    out.add(f"/{prefix}{svc.name}/{m.name}")
    return out


async def _ask(
    call: grpc.aio.StreamStreamCall[bytes, bytes], req: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    await call.write(req.SerializeToString())
    raw = await call.read()
    if raw is EOF:
        raise ConnectionError("reflection stream ended")
    assert isinstance(raw, bytes)
    resp = reflection_pb2.ServerReflectionResponse.FromString(raw)
    if resp.HasField("error_response"):
        raise LookupError(resp.error_response.error_message)
    return resp


async def _discover(channel: grpc.aio.Channel, method: str) -> set[str]:
    call = channel.stream_stream(method, None, None)(None, wait_for_ready=False)
    try:
        listed = await _ask(call, _Request(list_services=""))
        names = [s.name for s in listed.list_services_response.service]
        files: list[bytes] = []
        for name in names:
            resp = await _ask(call, _Request(file_containing_symbol=name))
            files.extend(resp.file_descriptor_response.file_descriptor_proto)
        await call.done_writing()
        # Keep only methods of the listed services: the files may also hold their dependencies.
        return {m for m in unary_methods_of(files) if m.split("/")[1] in names}
    finally:
        call.cancel()


async def discover_unary_methods(channel: grpc.aio.Channel, timeout: float) -> set[str]:
    """Unary methods the server behind `channel` lists through reflection (v1alpha, else v1).

    Raises on failure (TimeoutError after `timeout`, AioRpcError, ...): the caller decides how
    loud to be about it."""
    async with asyncio.timeout(timeout):
        for method in REFLECTION_METHODS[:-1]:
            try:
                return await _discover(channel, method)
            except grpc.aio.AioRpcError as e:
                if e.code() is not grpc.StatusCode.UNIMPLEMENTED:
                    raise
        return await _discover(channel, REFLECTION_METHODS[-1])
