"""TLS on both listeners of a live gateway, with a private CA: the openai SDK (plain and
streaming) and curl over HTTPS, grpcio over a secure channel, certificate rotation under load
with no failed request, a certificate file that does not load keeping the old one, on both HTTP
engines; h2load over TLS on the HTTP listener and the gRPC listener's HTTP/2 engine."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.proto import inference_pb2
from tests.integration.conftest import Backend
from tests.integration.h2_support import H2Gateway
from tests.integration.tls_gateway import (
    CHAT,
    CHAT_CONTENT,
    INFER,
    INFER_REPLY,
    TlsGateway,
    check_chat_answer,
    grpc_infer,
    https,
    post_chat,
    start_tls_gateway,
    tls_block,
)
from tests.support import require_binary, wait_until
from tests.tls_support import peer_serial, replace_atomically, visit

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["native", "aiohttp"])
def gw(
    request: pytest.FixtureRequest, backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsGateway]:
    # The native gateway serves gRPC on the h2 engine (the default), the aiohttp one on grpcio,
    # so every case here runs on both gRPC engines without more processes.
    grpc_engine = "h2" if request.param == "native" else "grpcio"
    g = start_tls_gateway(
        backend, tmp_path_factory.mktemp("tls"), request.param, grpc_engine=grpc_engine
    )
    try:
        yield g
    finally:
        assert g.proc.stop() == 0, g.proc.output()


def test_openai_sdk_over_tls_plain_and_streaming(gw: TlsGateway) -> None:
    import httpx2
    import openai

    with httpx2.Client(verify=gw.ca.client_context()) as http_client:
        client = openai.OpenAI(
            base_url=f"https://localhost:{gw.http_port}/v1",
            api_key="unused",
            http_client=http_client,
            max_retries=0,
            timeout=10,
        )
        done = client.chat.completions.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        (choice,) = done.choices
        assert choice.message.role == "assistant" and choice.message.content == CHAT_CONTENT
        assert choice.finish_reason == "length" and done.model == "m"
        assert done.usage is not None and done.usage.completion_tokens == 3
        chunks = list(
            client.chat.completions.create(
                model="m", max_tokens=3, stream=True, messages=[{"role": "user", "content": "hi"}]
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == CHAT_CONTENT and len(chunks) >= 3
        assert chunks[-1].choices[0].finish_reason == "length"


def test_curl_with_the_private_ca(gw: TlsGateway) -> None:
    curl = require_binary("curl")
    url = f"https://localhost:{gw.http_port}/v1/chat/completions"
    args = [curl, "-sS", "--max-time", "10", "-H", "content-type: application/json"]
    out = subprocess.run(
        [*args, "--cacert", str(gw.ca.path), "-d", json.dumps(CHAT), url],
        capture_output=True, timeout=15, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    check_chat_answer(json.loads(out.stdout))
    # Without the CA the certificate is not trusted: curl refuses it (exit 60).
    refused = subprocess.run([*args, url], capture_output=True, timeout=15, check=False)
    assert refused.returncode == 60, refused.stderr


def test_plaintext_client_is_not_served(gw: TlsGateway) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=5)
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected, OSError)):
        post_chat(conn)
    conn.close()


def test_grpc_over_a_secure_channel(gw: TlsGateway) -> None:
    assert grpc_infer(gw.grpc_port, gw.ca) == INFER_REPLY  # a reply: status OK (else RpcError)


def test_rotation_under_load_fails_no_request(gw: TlsGateway, tmp_path: Path) -> None:
    old = gw.served
    assert peer_serial("127.0.0.1", gw.http_port, gw.ca) == old.serial
    keep = https(gw)  # an open keep-alive connection, from before the rotation
    assert post_chat(keep)[0] == 200
    stop = threading.Event()
    results: list[int | str] = []

    def load() -> None:
        while not stop.is_set():
            conn = https(gw)  # a new connection (a new handshake) per request
            try:
                results.append(post_chat(conn)[0])
            except Exception as e:  # counted, never hidden
                results.append(repr(e))
            finally:
                conn.close()

    def grpc_load() -> None:
        while not stop.is_set():
            try:  # a new channel (a new handshake) per call
                grpc_infer(gw.grpc_port, gw.ca)
                results.append(200)
            except Exception as e:
                results.append(repr(e))

    threads = [threading.Thread(target=load) for _ in range(3)]
    threads.append(threading.Thread(target=grpc_load))
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(results) >= 20, what="load running")
        new = gw.ca.server("rotated", directory=tmp_path)
        replace_atomically(new.cert, gw.cert)
        replace_atomically(new.key, gw.key)
        started = time.monotonic()
        wait_until(
            lambda: peer_serial("127.0.0.1", gw.http_port, gw.ca) == new.serial,
            what="the HTTP listener serves the new certificate",
        )
        took = time.monotonic() - started
        wait_until(
            lambda: peer_serial("127.0.0.1", gw.grpc_port, gw.ca) == new.serial,
            what="the gRPC listener serves the new certificate",
        )
        n = len(results)
        wait_until(lambda: len(results) >= n + 20, what="load after the rotation")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    failed = [r for r in results if r != 200]
    assert not failed, failed[:5]
    assert took < 5.0
    # The connection opened before the rotation keeps working, on the old certificate.
    assert post_chat(keep)[0] == 200
    sock = keep.sock
    assert sock is not None
    from cryptography import x509

    der = sock.getpeercert(binary_form=True)
    assert der is not None and x509.load_der_x509_certificate(der).serial_number == old.serial
    keep.close()
    assert grpc_infer(gw.grpc_port, gw.ca) == INFER_REPLY
    gw.served = new
    state = json.loads(gw.get("/admin/state"))
    assert state["tls.http"]["serial"] == f"{new.serial:x}"
    assert state["tls.http"]["rotations"] >= 1


def test_a_file_that_does_not_load_keeps_the_old_certificate(
    gw: TlsGateway, tmp_path: Path
) -> None:
    served = gw.served
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    replace_atomically(garbage, gw.cert)
    wait_until(
        lambda: all("error" in gw.readyz()[f"tls.{n}"] for n in ("http", "grpc")),
        what="/readyz reports the bad file on both listeners",
    )
    ready = gw.readyz()
    assert ready["ready"] is True  # still serving
    assert "listeners.http.tls.cert" in ready["tls.http"]["error"]
    assert ready["tls.http"]["serial"] == f"{served.serial:x}"
    state = json.loads(gw.get("/admin/state"))
    assert state["tls.http"]["stale"] is True and state["tls.grpc"]["stale"] is True
    assert "tls.http: yellow" in state["reasons"]  # the status page says so too
    metrics = gw.get("/metrics").decode()
    assert 'sluice_tls_stale{listener="http"} 1.0' in metrics
    assert 'sluice_tls_reloads_total{listener="http",result="invalid"} 1.0' in metrics
    assert "sluice_tls_certificate_expiry_timestamp_seconds" in metrics
    # New connections still get the old certificate, and are served.
    assert peer_serial("127.0.0.1", gw.http_port, gw.ca) == served.serial
    conn = https(gw)
    assert post_chat(conn)[0] == 200
    conn.close()
    assert grpc_infer(gw.grpc_port, gw.ca) == INFER_REPLY
    # A good certificate clears it.
    good = gw.ca.server("good-again", directory=tmp_path)
    replace_atomically(good.key, gw.key)
    replace_atomically(good.cert, gw.cert)
    wait_until(
        lambda: not any("error" in gw.readyz()[f"tls.{n}"] for n in ("http", "grpc")),
        what="the error clears",
    )
    assert peer_serial("127.0.0.1", gw.http_port, gw.ca) == good.serial
    assert 'sluice_tls_stale{listener="http"} 0.0' in gw.get("/metrics").decode()
    # Logged once, though the bad file was looked at again until it was replaced.
    assert gw.proc.output().count("TLS files of the http listener changed but do not load") == 1
    gw.served = good


def test_a_returning_client_resumes_its_session(gw: TlsGateway) -> None:
    """Session resumption (TLS 1.3 tickets): a full handshake hands out one ticket, a second
    connection with that session resumes it (no certificate signature) and is served, and hands
    out a fresh one; a client without a session still gets a full handshake."""
    ctx = gw.ca.client_context()
    first = visit(gw.http_port, ctx)
    assert (first.status, first.resumed, first.tickets) == (200, False, 1)
    again = visit(gw.http_port, ctx, first.session)
    assert (again.status, again.resumed, again.tickets) == (200, True, 1)
    assert visit(gw.http_port, ctx, again.session).resumed
    assert not visit(gw.http_port, ctx).resumed


def test_a_client_that_never_finishes_the_handshake_is_closed(gw: TlsGateway) -> None:
    import socket

    for port in (gw.http_port, gw.grpc_port):
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, then silence
            try:
                assert s.recv(1024) == b""  # closed by the gateway (timeouts.tls_handshake_s: 2)
            except ConnectionResetError:
                pass
        assert 1.5 < time.monotonic() - started < 8.0


def test_files_that_do_not_load_at_start_are_fatal(backend: Backend, tmp_path: Path) -> None:
    missing = tmp_path / "missing.crt"
    block = tls_block(missing, tmp_path / "missing.key")
    with pytest.raises(AssertionError, match=r"the process exited \(1\)") as e:
        start_tls_gateway(backend, tmp_path, "native", http_tls=block, grpc_tls=block)
    assert f"listeners.http.tls.cert: cannot read {missing}" in str(e.value)


def test_alpn_h2_on_http_and_grpc(gw: TlsGateway) -> None:
    """The native engine offers h2 (its HTTP/2 engine) and HTTP/1.1; aiohttp's HTTP/1.1 only."""
    import socket

    def negotiated(port: int, offer: list[str]) -> str | None:
        ctx = gw.ca.client_context()
        ctx.set_alpn_protocols(offer)
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            return tls.selected_alpn_protocol()

    native = gw.engine == "native"
    assert negotiated(gw.http_port, ["h2", "http/1.1"]) == ("h2" if native else "http/1.1")
    assert negotiated(gw.http_port, ["http/1.1"]) == "http/1.1"
    assert negotiated(gw.grpc_port, ["h2"]) == "h2"


def test_http2_over_tls(gw: TlsGateway) -> None:
    """httpx with HTTP/2 and curl --http2 over TLS: JSON and SSE; h2 where the engine has it."""
    import httpx

    native = gw.engine == "native"
    with httpx.Client(http2=True, verify=gw.ca.client_context(), timeout=10) as c:
        url = f"https://localhost:{gw.http_port}/v1/chat/completions"
        r = c.post(url, json=CHAT)
        assert r.status_code == 200
        check_chat_answer(r.json())
        assert r.http_version == ("HTTP/2" if native else "HTTP/1.1")
        with c.stream("POST", url, json={**CHAT, "stream": True}) as s:
            assert s.status_code == 200
            body = "".join(s.iter_text())
        assert body.rstrip().endswith("data: [DONE]")
    curl = require_binary("curl")
    out = subprocess.run(
        [curl, "-sS", "--http2", "--max-time", "10", "--cacert", str(gw.ca.path),
         "-o", "/dev/null", "-w", "%{http_version}", f"https://localhost:{gw.http_port}/v1/models"],
        capture_output=True, text=True, timeout=15, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("2" if native else "1.1")


def test_every_worker_rotates(backend: Backend, tmp_path: Path) -> None:
    """`--workers 2`: each worker process watches the files itself; after a rotation every new
    connection, whichever worker accepts it, gets the new certificate."""
    gw = start_tls_gateway(backend, tmp_path, "native", workers=2)
    try:
        new = gw.ca.server("rotated", directory=tmp_path / "new")
        replace_atomically(new.cert, gw.cert)
        replace_atomically(new.key, gw.key)
        for port in (gw.http_port, gw.grpc_port):
            wait_until(
                lambda p=port: all(
                    peer_serial("127.0.0.1", p, gw.ca) == new.serial for _ in range(16)
                ),
                what=f"16 new connections in a row to {port} get the new certificate",
            )
        conn = https(gw)
        assert post_chat(conn)[0] == 200
        conn.close()
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


def test_h2load_over_tls_on_http_and_grpc(backend: Backend, tmp_path: Path) -> None:
    """h2load (h2 by ALPN; it does not verify the certificate) on the HTTP listener and on the
    gRPC listener with the HTTP/2 engine: every request succeeds, and every gRPC call ends with
    grpc-status 0 (h2load sees only the HTTP status, so the gateway's count is checked)."""
    h2load = require_binary("h2load")
    gw = start_tls_gateway(backend, tmp_path, "native", grpc_engine="h2")
    try:
        chat = tmp_path / "chat.json"
        chat.write_text(json.dumps(CHAT))
        message = inference_pb2.InferRequest(
            model="m", prompt="hi", max_tokens=2
        ).SerializeToString()
        infer = tmp_path / "infer.bin"
        infer.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)
        runs = {
            "http": [f"https://localhost:{gw.http_port}/v1/chat/completions",
                     "-d", str(chat), "-H", "content-type: application/json"],
            "grpc": [f"https://localhost:{gw.grpc_port}{INFER}", "-d", str(infer),
                     "-H", "content-type: application/grpc", "-H", "te: trailers"],
        }  # fmt: skip
        metrics = H2Gateway(gw.proc, gw.grpc_port, gw.admin_port)
        before = metrics.metric("sluice_requests_total", protocol="grpc", code="0")
        for name, args in runs.items():
            out = subprocess.run(
                [h2load, "-n", "600", "-c", "3", "-m", "10", *args],
                capture_output=True, text=True, timeout=120, check=False,
            ).stdout  # fmt: skip
            assert "TLS Protocol: TLSv1.3" in out and "Application protocol: h2" in out, out
            assert "600 succeeded, 0 failed, 0 errored" in out, (name, out)
            assert "600 2xx" in out, (name, out)
        assert metrics.metric("sluice_requests_total", protocol="grpc", code="0") == before + 600
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()
