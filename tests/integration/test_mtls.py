"""Client certificates (mTLS) on a live gateway: `required` refuses a client without a valid
certificate at the handshake (HTTP and gRPC); a verified certificate's identity is the rate-limit
key part `client_cert` and the principal of a request without a JWT; `optional` lets a client in
without one."""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.integration.conftest import Backend
from tests.integration.tls_gateway import (
    CHAT as CHAT_BODY,
)
from tests.integration.tls_gateway import (
    INFER_REPLY,
    TlsGateway,
    grpc_infer,
    post_chat,
    start_tls_gateway,
    tls_block,
)
from tests.tls_support import Issued, TestCA, visit

pytestmark = pytest.mark.integration

LIMITS = """auth:
  default: optional
  providers:
    - {{name: internal, issuer: internal, audiences: [sluice], algorithms: [HS256],
       secret: {{file: {secret}}}}}
rate_limits:
  rules:
    - name: per-client-cert
      key: [client_cert]
      qps: 0.3
      window_s: 10
"""


def gateway_with(
    backend: Backend, tmp: Path, engine: str, http_mode: str, grpc_mode: str
) -> tuple[TlsGateway, TestCA]:
    ca = TestCA(tmp / "ca")
    secret = tmp / "secret"
    secret.write_text("s" * 48)
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    gw = start_tls_gateway(
        backend, tmp, engine,
        http_tls=tls_block(cert, key, ca.path, http_mode),
        grpc_tls=tls_block(cert, key, ca.path, grpc_mode),
        tail=LIMITS.format(secret=secret),
        ca=ca,
    )  # fmt: skip
    return gw, ca


def client(ca: TestCA, cert: Issued | None) -> ssl.SSLContext:
    return ca.client_context(cert)


def chat(gw: TlsGateway, ctx: ssl.SSLContext) -> int:
    conn = http.client.HTTPSConnection("localhost", gw.http_port, context=ctx, timeout=5)
    try:
        return post_chat(conn)[0]
    finally:
        conn.close()


def until_limited(gw: TlsGateway, ctx: ssl.SSLContext, most: int = 20) -> int:
    """Requests sent before the first 429 (fails if none comes)."""
    for i in range(1, most + 1):
        status = chat(gw, ctx)
        if status == 429:
            return i
        assert status == 200, status
    raise AssertionError(f"no 429 within {most} requests")


@pytest.fixture(scope="module")
def required(
    backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TlsGateway, TestCA]]:
    gw, ca = gateway_with(
        backend, tmp_path_factory.mktemp("mtls"), "native", "required", "required"
    )
    try:
        yield gw, ca
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


def test_required_refuses_clients_without_a_valid_certificate(
    required: tuple[TlsGateway, TestCA], tmp_path: Path
) -> None:
    gw, ca = required
    stranger_ca = TestCA(tmp_path / "other")
    stranger = stranger_ca.issue("stranger", dns=("stranger.example",), client=True)
    for ctx in (client(ca, None), client(ca, None)):
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
            chat(gw, ctx)
    other = ca.client_context()
    other.load_cert_chain(stranger.cert, stranger.key)  # signed by a CA the gateway does not know
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        chat(gw, other)
    with pytest.raises(grpc.RpcError) as e:
        grpc_infer(gw.grpc_port, ca)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError):
        grpc_infer(gw.grpc_port, ca, stranger)


def test_certificate_identity_keys_the_limit_and_is_the_principal(
    required: tuple[TlsGateway, TestCA],
) -> None:
    gw, ca = required
    a = ca.issue("client-a", uris=("spiffe://sluice.test/a",), dns=("a.example",), client=True)
    b = ca.issue("client-b", dns=("b.example",), client=True)
    c = ca.issue("client-c", client=True)  # no SAN: the subject CN
    assert until_limited(gw, client(ca, a)) >= 2
    # Another certificate is another bucket.
    assert chat(gw, client(ca, b)) == 200
    # The same identity over gRPC shares the HTTP bucket; another one does not.
    with pytest.raises(grpc.RpcError) as e:
        grpc_infer(gw.grpc_port, ca, a)
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_infer(gw.grpc_port, ca, c) == INFER_REPLY
    with pytest.raises(grpc.RpcError) as e:  # CN over gRPC: the same bucket as CN over HTTP
        for _ in range(20):
            grpc_infer(gw.grpc_port, ca, c)
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    state = json.loads(gw.get("/admin/state"))
    shown = json.dumps(state["ratelimit"])
    for identity in ("spiffe://sluice.test/a", "b.example", "client-c"):
        assert identity in shown, shown[:2000]
    lines = [json.loads(x) for x in gw.proc.output().splitlines() if x.startswith("{")]
    served = [x for x in lines if x.get("status") == 200 or x.get("grpc_status") == 0]
    assert served and all(x.get("auth") == "client_cert" for x in served)


def test_a_resumed_session_keeps_the_certificate_identity(
    required: tuple[TlsGateway, TestCA],
) -> None:
    """A connection that resumes a session (no certificate sent again) is the same client: its
    requests use up the bucket of the certificate the session was verified with, not the
    anonymous one, and a full handshake with that certificate then finds the bucket empty."""
    gw, ca = required
    r = ca.issue("client-r", uris=("spiffe://sluice.test/r",), client=True)
    ctx = client(ca, r)
    body = json.dumps(CHAT_BODY).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    first = visit(gw.http_port, ctx, request=request)
    assert (first.status, first.resumed) == (200, False)
    session, statuses = first.session, []
    for _ in range(20):
        v = visit(gw.http_port, ctx, session, request=request)
        assert v.resumed
        statuses.append(v.status)
        session = v.session
        if v.status == 429:
            break
    assert statuses[-1] == 429 and set(statuses[:-1]) <= {200}, statuses
    assert visit(gw.http_port, ctx, request=request).status == 429  # full handshake, same bucket
    shown = json.dumps(json.loads(gw.get("/admin/state"))["ratelimit"])
    assert "spiffe://sluice.test/r" in shown


@pytest.fixture(scope="module")
def optional(
    backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TlsGateway, TestCA]]:
    gw, ca = gateway_with(
        backend, tmp_path_factory.mktemp("mtls-opt"), "aiohttp", "optional", "off"
    )
    try:
        yield gw, ca
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


def test_optional_lets_a_client_in_without_a_certificate(
    optional: tuple[TlsGateway, TestCA], tmp_path: Path
) -> None:
    gw, ca = optional
    assert chat(gw, client(ca, None)) == 200  # no certificate: in, without identity
    # client_cert: off on the gRPC listener: no certificate asked for (the anonymous bucket).
    assert grpc_infer(gw.grpc_port, ca) == INFER_REPLY
    a = ca.issue("opt-a", uris=("spiffe://sluice.test/opt-a",), client=True)
    assert until_limited(gw, client(ca, a)) >= 2  # its own bucket...
    assert chat(gw, client(ca, None)) == 200  # ...not the anonymous one
    shown = json.dumps(json.loads(gw.get("/admin/state"))["ratelimit"])
    assert "spiffe://sluice.test/opt-a" in shown
    # A certificate that is sent is verified: one from an unknown CA is refused.
    stranger = TestCA(tmp_path / "other").issue("stranger", client=True)
    other = ca.client_context()
    other.load_cert_chain(stranger.cert, stranger.key)
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        chat(gw, other)


def test_http2_streams_carry_the_certificate_identity(
    required: tuple[TlsGateway, TestCA],
) -> None:
    """Over h2 (ALPN), every stream of the connection is keyed by the connection's certificate:
    the bucket an HTTP/1.1 client with that certificate uses up refuses its HTTP/2 streams."""
    import httpx

    gw, ca = required
    d = ca.issue("client-d", dns=("d.example",), client=True)
    assert until_limited(gw, client(ca, d)) >= 2
    with httpx.Client(http2=True, verify=client(ca, d), timeout=10) as c:
        r = c.post(f"https://localhost:{gw.http_port}/v1/chat/completions", json=CHAT_BODY)
    assert r.http_version == "HTTP/2"
    assert r.status_code == 429, r.text
    e = ca.issue("client-e", dns=("e.example",), client=True)
    with httpx.Client(http2=True, verify=client(ca, e), timeout=10) as c:
        r = c.post(f"https://localhost:{gw.http_port}/v1/chat/completions", json=CHAT_BODY)
    assert (r.http_version, r.status_code) == ("HTTP/2", 200)
