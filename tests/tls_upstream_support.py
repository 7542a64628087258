"""Private CAs and certificates for the upstream TLS tests, made with `cryptography`: a CA, a
backend certificate for `backend.test` / `localhost` / 127.0.0.1, a client certificate for
mutual TLS, and a second CA that signed nothing the backends use (the "wrong CA")."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "backend.test"
Key = ec.EllipticCurvePrivateKey


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> Key:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: Key, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@dataclass
class Ca:
    name: str
    key: Key
    cert: x509.Certificate
    pem: Path

    def issue(
        self,
        cn: str,
        directory: Path,
        *,
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        client: bool = False,
        expired: bool = False,
    ) -> tuple[Path, Path]:
        """A leaf certificate and its key, written as `<cn>.crt` / `<cn>.key`."""
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=30)
        if expired:
            start, end = now - datetime.timedelta(days=30), now - datetime.timedelta(days=1)
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return (
            _write_cert(cert, directory / f"{cn}.crt"),
            _write_key(key, directory / f"{cn}.key"),
        )


def make_ca(name: str, directory: Path) -> Ca:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365))
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
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Ca(name, key, cert, _write_cert(cert, directory / f"{name}.pem"))


@dataclass
class Pki:
    """Everything one test module needs, in `directory`."""

    directory: Path
    ca: Ca  # signed the backend's and the client's certificates
    other_ca: Ca  # signed nothing in use
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca, other = make_ca("upstream-ca", directory), make_ca("other-ca", directory)
    server = ca.issue(SERVER_NAME, directory, dns=(SERVER_NAME, "localhost"), ips=("127.0.0.1",))
    client = ca.issue("sluice-client", directory, client=True)
    return Pki(directory, ca, other, *server, *client)
