"""Upstream TLS in-process, against the simulated backend serving real TLS with a CA the test
makes: the HTTP pool, the HTTP and gRPC health checks, the connect deadline over a handshake that
never ends, and how connections and channels are keyed by the TLS settings."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.errors import UpstreamTimeout, UpstreamTlsError
from gateway.mockbackend.server import MockBackendHandle, start_mock_backend
from gateway.mockbackend.tls import ServerTls
from gateway.policy.compiled import Endpoint, endpoint_of, route_timeouts
from gateway.policy.model import Limits, Policy, Timeouts
from gateway.registry.health import check_grpc, check_http
from gateway.tls.upstream import client_tls
from gateway.upstream.channels import ChannelPool, channel_options, open_channel
from gateway.upstream.pool import UpstreamPool
from tests.support import until
from tests.tls_support import SERVER_NAME, Pki, make_pki

T = route_timeouts(Timeouts(connect_s=1.0, first_byte_s=2.0, idle_s=2.0))
H = [(b"host", b"u")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def backend(pki: Pki) -> AsyncIterator[MockBackendHandle]:
    tls = ServerTls(str(pki.server.cert), str(pki.server.key))
    handle = await start_mock_backend("127.0.0.1:0", "127.0.0.1:0", tls=tls)
    try:
        yield handle
    finally:
        await handle.close()


def endpoint(port: int, protocol: str = "http", **tls: Any) -> Endpoint:
    doc = {"name": "b", "protocol": protocol, "endpoints": [{"address": f"127.0.0.1:{port}"}]}
    p = Policy.model_validate({"backends": [{**doc, "tls": tls}]})
    return endpoint_of(p.backends[0], f"127.0.0.1:{port}", 1, 0)


async def get(pool: UpstreamPool, ep: Endpoint) -> int:
    r = await pool.request(ep, "GET", "/healthz", H, None, T)
    while await r.read_chunk():
        pass
    r.release()
    return r.status


async def test_pool_verifies_the_backend_and_reuses_the_connection(
    pki: Pki, backend: MockBackendHandle
) -> None:
    assert backend.http_port is not None
    pool = UpstreamPool(Limits(), 30.0)
    ep = endpoint(backend.http_port, ca=str(pki.ca.path), server_name=SERVER_NAME)
    try:
        assert await get(pool, ep) == 200
        assert await get(pool, ep) == 200
        assert pool.state()[ep.address] == {"connections": 1, "idle": 1, "waiting": 0}
    finally:
        await pool.aclose()


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"ca": "other"}, "certificate verify failed: unable to get local issuer certificate"),
        ({"ca": "ca", "server_name": "wrong.test"}, "Hostname mismatch"),
        ({}, "certificate verify failed"),  # the system trust store does not know our CA
    ],
)
async def test_pool_refuses_a_backend_that_does_not_verify(
    pki: Pki, backend: MockBackendHandle, settings: dict[str, str], reason: str
) -> None:
    assert backend.http_port is not None
    files = {"ca": str(pki.ca.path), "other": str(pki.other_ca.path)}
    tls = {k: files.get(v, v) for k, v in settings.items()}
    pool = UpstreamPool(Limits(), 30.0)
    try:
        with pytest.raises(UpstreamTlsError) as e:
            await get(pool, endpoint(backend.http_port, **tls))
        assert reason in str(e.value)
        assert f"127.0.0.1:{backend.http_port}" not in pool.state()  # no connection was made
    finally:
        await pool.aclose()


async def test_an_expired_certificate_is_refused(pki: Pki, tmp_path: Path) -> None:
    expired = pki.ca.issue(
        "expired", dns=(SERVER_NAME,), ips=("127.0.0.1",), expired=True, directory=tmp_path
    )
    tls = ServerTls(str(expired.cert), str(expired.key))
    handle = await start_mock_backend("127.0.0.1:0", None, tls=tls)
    assert handle.http_port is not None
    pool = UpstreamPool(Limits(), 30.0)
    try:
        with pytest.raises(UpstreamTlsError) as e:
            await get(pool, endpoint(handle.http_port, ca=str(pki.ca.path)))
        assert "certificate verify failed: certificate has expired" in str(e.value)
    finally:
        await pool.aclose()
        await handle.close()


async def test_insecure_skip_verify_connects(backend: MockBackendHandle) -> None:
    assert backend.http_port is not None
    pool = UpstreamPool(Limits(), 30.0)
    try:
        assert await get(pool, endpoint(backend.http_port, insecure_skip_verify=True)) == 200
    finally:
        await pool.aclose()


async def test_the_connect_deadline_covers_the_handshake(pki: Pki) -> None:
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts, never answers the ClientHello
        writer.close()
        await writer.wait_closed()
        closed.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool(Limits(), 30.0)
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()
        with pytest.raises(UpstreamTimeout) as e:
            ep = endpoint(port, ca=str(pki.ca.path))
            await pool.request(ep, "GET", "/", H, None, dataclasses.replace(T, connect_s=0.3))
        assert e.value.phase == "connect"
        assert loop.time() - t0 < 2.0
        async with asyncio.timeout(5):  # the abandoned handshake's socket was closed
            await closed.wait()
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()


async def test_health_checks_over_tls(pki: Pki, backend: MockBackendHandle) -> None:
    assert backend.http_port is not None and backend.grpc_port is not None
    good = endpoint(backend.http_port, ca=str(pki.ca.path), server_name=SERVER_NAME)
    assert await check_http("127.0.0.1", backend.http_port, "/healthz", 2.0, good.tls) == (True, "")
    bad = endpoint(backend.http_port, ca=str(pki.other_ca.path))
    ok, err = await check_http("127.0.0.1", backend.http_port, "/healthz", 2.0, bad.tls)
    assert not ok and err.startswith("TLS certificate verify failed"), err
    plain_ok, _ = await check_http("127.0.0.1", backend.http_port, "/healthz", 2.0)
    assert not plain_ok  # no plaintext fallback: a TLS port does not answer plain HTTP

    options = channel_options(Limits())
    for tls, passes in (({"ca": str(pki.ca.path), "server_name": SERVER_NAME}, True),
                        ({"ca": str(pki.other_ca.path)}, False)):  # fmt: skip
        channel = open_channel(endpoint(backend.grpc_port, "grpc", **tls), options)
        try:
            ok, err = await check_grpc(channel, "", 3.0)
        finally:
            await channel.close(None)
        assert ok is passes, err
        if not passes:  # the reason, not grpc core's preamble
            assert err.startswith("UNAVAILABLE: Tls handshake failed"), err
            assert "CERTIFICATE_VERIFY_FAILED" in err, err


async def test_grpc_channel_with_a_client_certificate(pki: Pki) -> None:
    tls = ServerTls(str(pki.server.cert), str(pki.server.key), str(pki.ca.path))
    handle = await start_mock_backend(None, "127.0.0.1:0", tls=tls)
    assert handle.grpc_port is not None
    options = channel_options(Limits())
    ca = {"ca": str(pki.ca.path), "server_name": SERVER_NAME}
    mutual = {**ca, "cert": str(pki.client.cert), "key": str(pki.client.key)}
    try:
        for settings, passes in ((mutual, True), (ca, False)):
            channel = open_channel(endpoint(handle.grpc_port, "grpc", **settings), options)
            try:
                ok, err = await check_grpc(channel, "", 3.0)
            finally:
                await channel.close(None)
            assert ok is passes, err
    finally:
        await handle.close()


async def test_a_changed_tls_section_gets_its_own_connections(
    pki: Pki, backend: MockBackendHandle
) -> None:
    assert backend.http_port is not None
    pool = UpstreamPool(Limits(), 30.0)
    old = endpoint(backend.http_port, ca=str(pki.ca.path), server_name=SERVER_NAME)
    new = endpoint(backend.http_port, ca=str(pki.ca.path), server_name="localhost")
    try:
        assert await get(pool, old) == 200
        assert await get(pool, new) == 200  # not the idle connection verified for the old name
        assert pool.state()[old.address] == {"connections": 2, "idle": 2, "waiting": 0}
        assert await get(pool, old) == 200  # the old section's keeps its own
        assert pool.state()[old.address]["connections"] == 2
    finally:
        await pool.aclose()


def test_upstream_keys_follow_the_tls_settings(pki: Pki) -> None:
    ca = str(pki.ca.path)
    a, again = endpoint(9000, ca=ca), endpoint(9000, ca=ca)  # two loads of the same settings
    assert a.tls is not again.tls and a.upstream_key == again.upstream_key
    named = endpoint(9000, ca=ca, server_name=SERVER_NAME)
    assert named.upstream_key != a.upstream_key and named.address == a.address
    plain = endpoint_of(
        Policy.model_validate({"backends": [{"name": "b", "endpoints": [{"address": "h:1"}]}]})
        .backends[0], "h:1", 1, 0,
    )  # fmt: skip
    assert plain.tls is None and plain.upstream_key == "h:1"
    # Built once per settings object: every member of the backend shares the contexts.
    p = Policy.model_validate(
        {"backends": [{"name": "b", "endpoints": [{"address": "h:1"}], "tls": {"ca": ca}}]}
    )
    b = p.backends[0]
    assert b.tls is not None
    assert endpoint_of(b, "h:1", 1, 0).tls is endpoint_of(b, "h:2", 1, 0).tls is client_tls(b.tls)


async def test_a_changed_tls_section_gets_its_own_channel(pki: Pki) -> None:
    pool = ChannelPool(Limits())
    old = endpoint(9001, "grpc", ca=str(pki.ca.path))
    new = endpoint(9001, "grpc", ca=str(pki.ca.path), server_name=SERVER_NAME)
    try:
        old_channel = pool.get(old)
        assert pool.get(new) is not old_channel and pool.get(old) is old_channel
        assert pool.addresses() == {"127.0.0.1:9001"}
        assert await pool.prune({new.upstream_key}, grace=0) == 1  # the old one drains
        await until(old_channel.get_state, ok=lambda s: s is grpc.ChannelConnectivity.SHUTDOWN)
        with pytest.raises(grpc.aio.UsageError):
            await old_channel.unary_unary("/a.B/C", None, None)(b"")
    finally:
        await pool.aclose()
