"""Upstream channel pool and reflection discovery, against real grpc.aio servers on port 0."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import grpc.aio
import pytest
from google.protobuf import descriptor_pb2  # type: ignore[import-untyped]

from gateway import app
from gateway.app import Gateway
from gateway.policy.compiled import Endpoint
from gateway.policy.model import Limits
from gateway.upstream.channels import ChannelPool, channel_options
from gateway.upstream.reflection import unary_methods_of
from tests.adapters.test_grpc import GENERATE, INFER, pb2, upstream_server, write_policy
from tests.support import free_port, until


def endpoint(port: int) -> Endpoint:
    return Endpoint("infer", "grpc", "127.0.0.1", port, 1)


async def test_one_channel_per_endpoint_reused(tmp_path: Path) -> None:
    gateway = Gateway(write_policy(tmp_path, 1))
    pool = gateway.channels
    try:
        a, b = endpoint(free_port()), endpoint(free_port())
        assert pool.get(a) is pool.get(a)
        assert pool.get(a) is not pool.get(b)
        assert pool.unary(a, INFER) is pool.unary(a, INFER)
        assert pool.stream(a, GENERATE) is pool.stream(a, GENERATE)
        assert pool.addresses() == {a.address, b.address}
    finally:
        await gateway.aclose()
    assert pool.addresses() == set()


async def test_prune_closes_channels_of_endpoints_gone_after_reload(tmp_path: Path) -> None:
    old_port, new_port = free_port(), free_port()
    policy = write_policy(tmp_path, old_port)
    gateway = Gateway(policy)
    pool: ChannelPool = gateway.channels
    try:
        old = pool.get(endpoint(old_port))
        assert await gateway.prune_channels(grace=0) == 0  # still in the policy: kept
        write_policy(tmp_path, new_port)
        assert gateway.holder.reload().changed
        new = pool.get(endpoint(new_port))
        assert await gateway.prune_channels(grace=0) == 1
        assert pool.addresses() == {endpoint(new_port).address}
        # The close runs in the background.
        await until(old.get_state, ok=lambda s: s is grpc.ChannelConnectivity.SHUTDOWN)
        with pytest.raises(grpc.aio.UsageError):
            await old.unary_unary("/a.B/C", None, None)(b"")
        assert pool.get(endpoint(new_port)) is new
    finally:
        await gateway.aclose()


async def test_channels_nobody_names_are_closed_without_a_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Members a registry found come and go between reloads: the channels of those that left
    # are closed every PRUNE_S, not only at the next reload.
    monkeypatch.setattr(app, "PRUNE_S", 0.05)
    gateway = Gateway(write_policy(tmp_path, free_port()))
    pool = gateway.channels
    try:
        named = endpoint(gateway.active.policy.routes[0].endpoints[0].port)
        pool.get(named)
        for _ in range(20):  # members that left (nothing names them)
            pool.get(endpoint(free_port()))
        await until(pool.addresses, 2.0, ok=lambda a: a == {named.address},
                    what="the channels nobody names closed")  # fmt: skip
    finally:
        await gateway.aclose()


async def test_prune_closes_channels_whose_options_changed(tmp_path: Path) -> None:
    async with upstream_server() as (_, port):
        gateway = Gateway(write_policy(tmp_path, port))
        try:
            before = gateway.channels.get(endpoint(port))
            write_policy(tmp_path, port, max_message=4096)
            assert gateway.holder.reload().changed
            assert await gateway.prune_channels(grace=0) == 1
            assert gateway.channels.get(endpoint(port)) is not before
        finally:
            await gateway.aclose()


async def test_pruned_channel_lets_a_running_call_finish_within_grace(tmp_path: Path) -> None:
    async with upstream_server() as (_, port):
        gateway = Gateway(write_policy(tmp_path, port))
        try:
            req = pb2.InferRequest(prompt="slow", max_tokens=6).SerializeToString()
            call = gateway.channels.stream(endpoint(port), GENERATE)(iter([req]))
            assert await call.read() is not None
            write_policy(tmp_path, free_port())
            assert gateway.holder.reload().changed
            assert await gateway.prune_channels(grace=5) == 1
            while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                pass
            assert await call.code() is grpc.StatusCode.OK
        finally:
            await gateway.aclose()


async def test_discover_unary_through_reflection(tmp_path: Path) -> None:
    async with upstream_server() as (_, port):
        gateway = Gateway(write_policy(tmp_path, port))
        try:
            methods = await gateway.channels.discover_unary(endpoint(port), timeout=2.0)
        finally:
            await gateway.aclose()
    assert methods == {INFER}  # Generate, Collect, Chat and reflection itself are streaming


@pytest.mark.parametrize("reflection", [False, None])
async def test_discover_unary_fails_soft(tmp_path: Path, reflection: bool | None) -> None:
    """No reflection service (UNIMPLEMENTED) or nothing listening: an empty set, no raise."""
    gateway = Gateway(write_policy(tmp_path, 1))
    try:
        if reflection is None:
            t0 = time.monotonic()
            assert await gateway.channels.discover_unary(endpoint(free_port()), 0.5) == set()
            assert time.monotonic() - t0 < 1.5
        else:
            async with upstream_server(with_reflection=False) as (_, port):
                assert await gateway.channels.discover_unary(endpoint(port), 2.0) == set()
    finally:
        await gateway.aclose()


def test_unary_methods_of_reads_streaming_flags() -> None:
    fdp = descriptor_pb2.FileDescriptorProto(name="x.proto", package="pkg.v1")
    svc = fdp.service.add(name="Svc")
    svc.method.add(name="Unary", input_type=".pkg.v1.M", output_type=".pkg.v1.M")
    svc.method.add(name="Server", server_streaming=True)
    svc.method.add(name="Client", client_streaming=True)
    bare = descriptor_pb2.FileDescriptorProto(name="y.proto")
    bare.service.add(name="Top").method.add(name="Ping")
    got = unary_methods_of([fdp.SerializeToString(), bare.SerializeToString()])
    assert got == {"/pkg.v1.Svc/Unary", "/Top/Ping"}


def test_channel_options_follow_limits() -> None:
    limits = Limits(grpc_max_message_bytes=1234, grpc_max_upstream_metadata_bytes=99999)
    opts = dict(channel_options(limits))
    assert opts["grpc.max_receive_message_length"] == 1234
    assert opts["grpc.max_send_message_length"] == 1234
    # what a backend may send, soft and hard limit alike (not the ingress metadata cap)
    assert opts["grpc.max_metadata_size"] == opts["grpc.absolute_max_metadata_size"] == 99999
    assert opts["grpc.enable_retries"] == 0
