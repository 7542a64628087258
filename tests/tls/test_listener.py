"""The TLS owner of a listener, in process: a change is loaded once it held still for one look,
files that do not load keep the old material (and say why), and the client identity rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import TlsError
from gateway.policy.base import ListenerTls
from gateway.telemetry import metrics
from gateway.tls.listener import TlsOwner
from gateway.tls.material import grpc_identity, identity
from tests.tls_support import TestCA, replace_atomically


@pytest.fixture
def setup(tmp_path: Path) -> tuple[TestCA, ListenerTls, TlsOwner]:
    ca = TestCA(tmp_path / "ca")
    first = ca.server("first")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    replace_atomically(first.cert, cert)
    replace_atomically(first.key, key)
    cfg = ListenerTls(cert=str(cert), key=str(key), client_ca=str(ca.path), client_cert="optional")
    return ca, cfg, TlsOwner("http", cfg)


def stale() -> float:
    value = metrics.REGISTRY.get_sample_value("sluice_tls_stale", {"listener": "http"})
    assert value is not None
    return value


def test_a_change_loads_after_holding_still_for_one_look(
    setup: tuple[TestCA, ListenerTls, TlsOwner], tmp_path: Path
) -> None:
    ca, cfg, owner = setup
    first = owner.material.serial
    assert owner.poll() is False  # nothing changed
    new = ca.server("second", directory=tmp_path / "new")
    replace_atomically(new.cert, Path(cfg.cert))
    assert owner.poll() is False  # changed: the writer gets one more interval (the key)
    replace_atomically(new.key, Path(cfg.key))
    assert owner.poll() is False  # changed again
    assert owner.material.serial == first
    assert owner.poll() is True
    assert owner.material.serial == new.serial and owner.generation == 1
    assert owner.poll() is False
    expiry = metrics.REGISTRY.get_sample_value(
        "sluice_tls_certificate_expiry_timestamp_seconds", {"listener": "http"}
    )
    assert expiry == owner.material.not_after
    assert owner.state()["rotations"] == 1
    assert owner.state()["colour"] == "green"


@pytest.mark.parametrize("fault", ["garbage", "mismatch", "expired", "missing"])
def test_files_that_do_not_load_keep_the_old_material(
    setup: tuple[TestCA, ListenerTls, TlsOwner], tmp_path: Path, fault: str
) -> None:
    ca, cfg, owner = setup
    served = owner.material
    cert, key = Path(cfg.cert), Path(cfg.key)
    if fault == "garbage":
        cert.write_text("garbage")
    elif fault == "mismatch":
        replace_atomically(ca.server("other", directory=tmp_path / "o").key, key)
    elif fault == "expired":
        old = ca.server("old", expired=True, directory=tmp_path / "x")
        replace_atomically(old.cert, cert)
        replace_atomically(old.key, key)
    else:
        cert.unlink()
    before = metrics.REGISTRY.get_sample_value(
        "sluice_tls_reloads_total", {"listener": "http", "result": _reason(fault)}
    )
    owner.poll()
    owner.poll()
    owner.poll()  # looked at three times, tried once
    assert owner.material is served
    assert owner.error_reason == _reason(fault)
    assert owner.readiness()["stale"] is True
    assert owner.state()["colour"] == "yellow"
    assert stale() == 1.0
    after = metrics.REGISTRY.get_sample_value(
        "sluice_tls_reloads_total", {"listener": "http", "result": _reason(fault)}
    )
    assert after == (before or 0.0) + 1
    fixed = ca.server("fixed", directory=tmp_path / "f")
    replace_atomically(fixed.key, key)
    replace_atomically(fixed.cert, cert)
    owner.poll()
    assert owner.poll() is True
    assert owner.error == "" and "stale" not in owner.readiness() and stale() == 0.0


def _reason(fault: str) -> str:
    return {"garbage": "invalid", "missing": "unreadable"}.get(fault, fault)


def test_the_first_load_is_fatal(tmp_path: Path) -> None:
    cfg = ListenerTls(cert=str(tmp_path / "none.crt"), key=str(tmp_path / "none.key"))
    with pytest.raises(TlsError) as e:
        TlsOwner("grpc", cfg)
    assert str(e.value).startswith("listeners.grpc.tls.cert: cannot read ")


def test_context_settings(setup: tuple[TestCA, ListenerTls, TlsOwner]) -> None:
    import ssl

    _, _, owner = setup
    ctx = owner.context
    assert ctx.minimum_version is ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode is ssl.CERT_OPTIONAL
    assert ctx.options & ssl.OP_NO_COMPRESSION
    assert ctx.num_tickets == 1  # TLS 1.3 session tickets on, one per full handshake
    assert ctx.sni_callback is None  # until the first rotation: no Python in the handshake
    assert owner.verifies_clients


@pytest.mark.parametrize(
    ("peercert", "expected"),
    [
        (None, ""),
        ({}, ""),
        (
            {
                "subject": ((("commonName", "cn"),),),
                "subjectAltName": (("DNS", "a.example"), ("URI", "spiffe://t/a")),
            },
            "spiffe://t/a",
        ),
        ({"subject": ((("commonName", "cn"),),), "subjectAltName": (("DNS", "a.x"),)}, "a.x"),
        ({"subject": ((("organizationName", "o"),), (("commonName", "cn"),))}, "cn"),
        ({"subjectAltName": (("IP Address", "10.0.0.1"),)}, ""),
    ],
)
def test_identity(peercert: dict[str, object] | None, expected: str) -> None:
    assert identity(peercert) == expected


def test_grpc_identity() -> None:
    assert grpc_identity({"peer_uri": [b"spiffe://t/a"], "peer_dns": [b"a.x"]}) == "spiffe://t/a"
    assert grpc_identity({"peer_dns": [b"a.x"], "x509_common_name": [b"cn"]}) == "a.x"
    assert grpc_identity({"x509_common_name": [b"cn"]}) == "cn"
    assert grpc_identity({"transport_security_type": [b"ssl"]}) == ""


async def test_sni_callback_rotates_new_connections_on_the_stdlib_loop(
    setup: tuple[TestCA, ListenerTls, TlsOwner], tmp_path: Path
) -> None:
    """The rotation mechanism itself, on asyncio's own SSL transport (the gateway runs uvloop;
    tests/integration/test_tls.py covers that): new connections get the new certificate, an
    open one keeps its session and keeps working, a session from before resumes."""
    import asyncio
    import socket
    import ssl

    from cryptography import x509

    ca, cfg, owner = setup

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.readline():
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(
        echo, "127.0.0.1", 0, ssl=owner.context, ssl_handshake_timeout=5
    )
    port = server.sockets[0].getsockname()[1]

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
        r, w = await asyncio.wait_for(
            asyncio.open_connection(
                "127.0.0.1", port, ssl=ca.client_context(), server_hostname="localhost"
            ),
            5,
        )
        der = w.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return r, w, x509.load_der_x509_certificate(der).serial_number

    async def roundtrip(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bytes:
        w.write(b"ping\n")
        return await asyncio.wait_for(r.readline(), 5)

    client = ca.client_context()  # a session resumes with the context that made it

    def blocking(session: ssl.SSLSession | None) -> tuple[ssl.SSLSession | None, bool]:
        """A connection of its own (resuming `session`): one line echoed; (session, resumed)."""
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            client.wrap_socket(raw, server_hostname="localhost", session=session) as tls,
        ):
            tls.sendall(b"ping\n")
            assert tls.recv(16) == b"ping\n"  # the ticket came before it: the session is set
            return tls.session, bool(tls.session_reused)

    try:
        r1, w1, first = await connect()
        assert first == owner.material.serial
        before, resumed = await asyncio.to_thread(blocking, None)
        assert not resumed
        assert owner.context.sni_callback is None
        new = ca.server("second", directory=tmp_path / "new")
        replace_atomically(new.cert, Path(cfg.cert))
        replace_atomically(new.key, Path(cfg.key))
        owner.poll()
        assert owner.poll() is True
        assert owner.context.sni_callback is not None
        r2, w2, second = await connect()
        assert second == new.serial
        assert await roundtrip(r1, w1) == b"ping\n"  # the open connection, untouched
        assert await roundtrip(r2, w2) == b"ping\n"
        # A session from before the rotation still resumes (tickets are sealed with the first
        # context's keys, which the listener keeps).
        assert (await asyncio.to_thread(blocking, before))[1]
        for w in (w1, w2):
            w.close()
            await w.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


def test_a_kubernetes_secret_volume_swap_is_seen(tmp_path: Path) -> None:
    """A secret volume: tls.crt -> ..data/tls.crt, ..data -> ..<timestamp>/; an update writes a
    new timestamped directory and swaps the ..data symlink in one rename."""
    import os

    ca = TestCA(tmp_path / "ca")
    vol = tmp_path / "vol"
    vol.mkdir()

    def version(name: str) -> int:
        issued = ca.server(name, directory=vol / f"..{name}")
        for f in ("crt", "key"):
            (vol / f"..{name}" / f"tls.{f}").symlink_to(f"{name}.{f}")
        tmp_link = vol / "..data_tmp"
        tmp_link.symlink_to(f"..{name}")
        os.replace(tmp_link, vol / "..data")
        return issued.serial

    first = version("v1")
    for f in ("crt", "key"):
        (vol / f"tls.{f}").symlink_to(f"..data/tls.{f}")
    owner = TlsOwner("http", ListenerTls(cert=str(vol / "tls.crt"), key=str(vol / "tls.key")))
    assert owner.material.serial == first
    second = version("v2")
    owner.poll()
    assert owner.poll() is True
    assert owner.material.serial == second
