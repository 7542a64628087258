"""The gRPC listener on the HTTP/2 engine over TLS (`listeners.grpc.engine: h2`): grpcio secure
channels, ALPN h2, client_cert optional (which the grpcio engine cannot offer) with the verified
identity keying a rate limit, and certificate rotation through the listener's TLS owner."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.integration.conftest import Backend
from tests.integration.test_mtls import LIMITS
from tests.integration.tls_gateway import (
    INFER_REPLY,
    TlsGateway,
    grpc_infer,
    start_tls_gateway,
    tls_block,
)
from tests.support import wait_until
from tests.tls_support import TestCA, peer_serial, replace_atomically

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gw(backend: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsGateway]:
    tmp = tmp_path_factory.mktemp("grpc-h2-tls")
    ca = TestCA(tmp / "ca")
    secret = tmp / "secret"
    secret.write_text("s" * 48)
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    g = start_tls_gateway(
        backend, tmp, "native",
        grpc_tls=tls_block(cert, key, ca.path, "optional"),
        grpc_engine="h2",
        tail=LIMITS.format(secret=secret),
        ca=ca,
    )  # fmt: skip
    try:
        yield g
    finally:
        assert g.proc.stop() == 0, g.proc.output()


def test_alpn_selects_h2(gw: TlsGateway) -> None:
    ctx = gw.ca.client_context()
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", gw.grpc_port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        assert tls.selected_alpn_protocol() == "h2"


def test_secure_channel_without_a_certificate_is_served(gw: TlsGateway) -> None:
    assert grpc_infer(gw.grpc_port, gw.ca) == INFER_REPLY  # a reply: status OK (else RpcError)


def test_optional_client_certificate_identity_keys_the_limit(gw: TlsGateway) -> None:
    a = gw.ca.issue("grpc-a", uris=("spiffe://sluice.test/grpc-a",), client=True)
    with pytest.raises(grpc.RpcError) as e:
        for _ in range(20):
            grpc_infer(gw.grpc_port, gw.ca, a)
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_infer(gw.grpc_port, gw.ca) == INFER_REPLY  # the anonymous bucket is another
    shown = json.dumps(json.loads(gw.get("/admin/state"))["ratelimit"])
    assert "spiffe://sluice.test/grpc-a" in shown


def test_a_certificate_from_an_unknown_ca_is_refused(gw: TlsGateway, tmp_path: Path) -> None:
    stranger = TestCA(tmp_path / "other").issue("stranger", client=True)
    with pytest.raises(grpc.RpcError) as e:
        grpc_infer(gw.grpc_port, gw.ca, stranger)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE


def test_rotation_reaches_new_connections(gw: TlsGateway) -> None:
    before = peer_serial("127.0.0.1", gw.grpc_port, gw.ca)
    assert before == gw.served.serial
    fresh = gw.ca.server()
    replace_atomically(fresh.key, gw.key)
    replace_atomically(fresh.cert, gw.cert)
    wait_until(
        lambda: peer_serial("127.0.0.1", gw.grpc_port, gw.ca) == fresh.serial,
        what="the gRPC listener serves the new certificate",
    )
    assert grpc_infer(gw.grpc_port, gw.ca) == INFER_REPLY


def test_tls_handshake_is_required(gw: TlsGateway) -> None:
    with (
        grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as ch,
        pytest.raises(grpc.RpcError) as e,
    ):
        ch.unary_unary("/sluice.inference.v1.Inference/Infer")(b"", timeout=3)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
