"""Private CAs for tests: each issues server and client certificates as PEM files, for the
listeners' TLS (`TestCA`) and for the backends' (`make_pki`: a CA, a backend certificate, a
client certificate for mutual TLS, and a second CA that signed nothing the backends use).

Real X.509 (the `cryptography` package), ECDSA P-256 keys; every certificate gets a fresh serial
so that a test can tell a rotated certificate from the one before it.
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_KEY_PEM = serialization.PrivateFormat.TraditionalOpenSSL


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, _KEY_PEM, serialization.NoEncryption())


@dataclass
class Issued:
    cert: Path
    key: Path
    serial: int


class TestCA:
    """A self-signed CA in `directory` (`path`: ca.crt); `issue` writes a leaf certificate and
    key."""

    __test__ = False  # not a pytest class

    def __init__(self, directory: Path, name: str = "Sluice Test CA") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),  # fmt: skip
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        self.path = self.dir / "ca.crt"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        name: str,
        *,
        dns: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        client: bool = False,
        days: float = 10.0,
        expired: bool = False,
        directory: Path | None = None,
    ) -> Issued:
        """A leaf certificate with CN `name` and the given SANs, written as NAME.crt/NAME.key."""
        import ipaddress

        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)
        if expired:
            start, end = now - dt.timedelta(days=3), now - dt.timedelta(days=1)
        serial = x509.random_serial_number()
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        sans += [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(self.key, hashes.SHA256())
        out = directory or self.dir
        out.mkdir(parents=True, exist_ok=True)
        crt, kp = out / f"{name}.crt", out / f"{name}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        kp.write_bytes(_key_pem(key))
        return Issued(crt, kp, serial)

    def server(self, name: str = "localhost", **kw: object) -> Issued:
        """A server certificate for localhost and 127.0.0.1."""
        return self.issue(name, dns=("localhost",), ips=("127.0.0.1",), **kw)  # type: ignore[arg-type]

    def client_context(self, client: Issued | None = None) -> ssl.SSLContext:
        """A client context that trusts this CA (and presents `client` if given)."""
        ctx = ssl.create_default_context(cafile=str(self.path))
        if client is not None:
            ctx.load_cert_chain(client.cert, client.key)
        return ctx


SERVER_NAME = "backend.test"  # the name on the simulated backends' certificate


@dataclass
class Pki:
    """Everything one upstream TLS test module needs, in `directory`."""

    directory: Path
    ca: TestCA  # signed the backend's and the client's certificates
    other_ca: TestCA  # signed nothing in use
    server: Issued  # the backends' certificate: backend.test, localhost, 127.0.0.1
    client: Issued  # Sluice's client certificate for mutual TLS


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = TestCA(directory / "upstream-ca", "upstream-ca")
    other = TestCA(directory / "other-ca", "other-ca")
    server = ca.issue(
        SERVER_NAME, dns=(SERVER_NAME, "localhost"), ips=("127.0.0.1",), directory=directory
    )
    client = ca.issue("sluice-client", client=True, directory=directory)
    return Pki(directory, ca, other, server, client)


def replace_atomically(src: Path, dst: Path) -> None:
    """Write `src`'s bytes over `dst` the way a secret update does: temp file, fsync, rename."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(src.read_bytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dst)


def peer_serial(host: str, port: int, ca: TestCA, timeout: float = 5.0) -> int:
    """The serial number of the certificate a new TLS connection to host:port is served."""
    import socket

    ctx = ca.client_context()
    with (
        socket.create_connection((host, port), timeout=timeout) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


def peer_identity_of(cert: Path) -> str:
    """The mTLS identity Sluice derives from a certificate file (as the ssl module decodes it)."""
    from gateway.tls.material import identity

    decoded = ssl._ssl._test_decode_cert(str(cert))  # type: ignore[attr-defined]
    return identity(decoded)


@dataclass
class Visit:
    """One HTTPS request on a connection of its own (`visit`)."""

    status: int
    session: ssl.SSLSession | None  # to resume with (after the server's tickets were read)
    resumed: bool  # the handshake resumed the session given (`SSLSocket.session_reused`)
    tickets: int  # TLS 1.3 NewSessionTicket messages the server sent on this connection


def visit(
    port: int,
    ctx: ssl.SSLContext,
    session: ssl.SSLSession | None = None,
    request: bytes = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    timeout: float = 5.0,
) -> Visit:
    """Connect to 127.0.0.1:`port` with `ctx` (resuming `session` if given), send `request`,
    read the answer to the server's close. `ctx` gets a message callback that counts tickets."""
    import socket

    tickets = [0]

    def seen(conn: object, direction: str, version: object, kind: object, msg: object,
             data: bytes) -> None:  # fmt: skip
        if direction == "read" and msg == ssl._TLSMessageType.NEWSESSION_TICKET:  # type: ignore[attr-defined]
            tickets[0] += 1

    ctx._msg_callback = seen  # type: ignore[attr-defined]  # the ssl module's debugging hook
    with (
        socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost", session=session) as tls,
    ):
        resumed = bool(tls.session_reused)
        tls.sendall(request)
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
        return Visit(status, tls.session, resumed, tickets[0])
