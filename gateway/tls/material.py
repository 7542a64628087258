"""A listener's TLS material: its files read once, checked, and built into an `ssl.SSLContext`.

`load_material(cfg, alpn)` reads the certificate chain, the key and the client CA (if any), and
refuses, with a `TlsError` naming the field at fault: a file that cannot be read, is not PEM,
holds no certificate or key, a key that does not match the certificate, a certificate that has
expired or is not valid yet. The context is TLS 1.2 minimum on the standard library's secure
server defaults (`PROTOCOL_TLS_SERVER`; options only ever added with `|=`, since an assignment
would clear those defaults), with the listener's ALPN protocols, session resumption by TLS 1.3
tickets (one per full handshake) and, with a client CA, client certificates asked for (optional)
or required.

The context is loaded from the paths (the ssl module has no in-memory loader); the files are
read again afterwards and a difference (a writer between our two reads) is a `Changing` error, to
be retried at the next look, never reported. `identity(peercert)` is the client identity rule of
mTLS: first URI SAN, else first DNS SAN, else the subject CN.
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from gateway.errors import TlsError
from gateway.policy.base import ListenerTls
from gateway.tls.files import read_pem

TICKETS_PER_HANDSHAKE = 1  # TLS 1.3 session tickets sent after a full handshake (see build_context)
MAX_IDENTITY = 256  # characters of a client identity kept (keys cut further, to 128)

Signature = tuple[tuple[int, int, int, int] | None, ...]


class Changing(Exception):
    """A file changed while it was being loaded: look again later."""


@dataclass(frozen=True, slots=True)
class Material:
    """What one load of a listener's files gave: the context and the facts shown about it."""

    context: ssl.SSLContext
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes | None
    serial: int
    subject: str
    not_after: float  # Unix time
    signature: Signature


def files(cfg: ListenerTls) -> tuple[tuple[str, str], ...]:
    """(policy field, path) of each file the listener reads."""
    out = [("cert", cfg.cert), ("key", cfg.key)]
    if cfg.client_ca is not None:
        out.append(("client_ca", cfg.client_ca))
    return tuple(out)


def signature(cfg: ListenerTls) -> Signature:
    """(dev, inode, mtime, size) of each file (None if it cannot be stat'ed); `os.stat`
    follows symlinks, so a Kubernetes secret volume's `..data` swap changes it too."""
    out: list[tuple[int, int, int, int] | None] = []
    for _, path in files(cfg):
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


def _certificates(field: str, path: str, pem: bytes) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        certs = []
    if not certs:
        raise TlsError(field, "invalid", f"{path} holds no PEM certificate")
    return certs


def _check_validity(path: str, leaf: x509.Certificate, now: float) -> None:
    start = leaf.not_valid_before_utc.timestamp()
    end = leaf.not_valid_after_utc.timestamp()
    if end <= now:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(end))
        raise TlsError("cert", "expired", f"the certificate in {path} expired at {when}")
    if start > now:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start))
        raise TlsError("cert", "not_yet_valid", f"the certificate in {path} is valid from {when}")


def _spki(public_key: Any) -> bytes:
    der: bytes = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return der


def _check_key(cfg: ListenerTls, leaf: x509.Certificate, key_pem: bytes) -> None:
    try:
        key = load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise TlsError(
            "key", "invalid", f"{cfg.key} is encrypted (give an unencrypted key)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise TlsError("key", "invalid", f"{cfg.key} holds no PEM private key") from None
    if _spki(key.public_key()) != _spki(leaf.public_key()):
        raise TlsError("key", "mismatch", f"{cfg.key} is not the key of the certificate {cfg.cert}")


def build_context(cfg: ListenerTls, alpn: Sequence[str]) -> ssl.SSLContext:
    """The server context from the files at `cfg`'s paths (raises ssl.SSLError / OSError)."""
    # Not create_default_context(Purpose.CLIENT_AUTH): it trusts the system CAs for client
    # certificates, and with mTLS on any publicly issued certificate would get in.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # secure defaults: no SSLv3, no compression
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    ctx.load_cert_chain(cfg.cert, cfg.key)
    if cfg.client_ca is not None and cfg.client_cert != "off":
        ctx.load_verify_locations(cafile=cfg.client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.client_cert == "required" else ssl.CERT_OPTIONAL
    else:
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(list(alpn))
    # TLS 1.3 session tickets stay on (a returning client resumes: no certificate signature,
    # nothing to verify on its side), one per full handshake instead of OpenSSL's two: each
    # costs ~30 µs of the handshake (the session serialised, encrypted and MACed), a reconnecting
    # client uses one, and every resumption hands out a fresh one.
    ctx.num_tickets = TICKETS_PER_HANDSHAKE
    return ctx


def load_material(cfg: ListenerTls, alpn: Sequence[str], now: float | None = None) -> Material:
    """Read and check the files, build the context (raises TlsError, or Changing)."""
    now = time.time() if now is None else now
    sig = signature(cfg)
    cert_pem = read_pem("cert", cfg.cert)
    key_pem = read_pem("key", cfg.key)
    leaf = _certificates("cert", cfg.cert, cert_pem)[0]
    _check_key(cfg, leaf, key_pem)
    _check_validity(cfg.cert, leaf, now)
    ca_pem = None
    if cfg.client_ca is not None:
        ca_pem = read_pem("client_ca", cfg.client_ca)
        _certificates("client_ca", cfg.client_ca, ca_pem)
    try:
        ctx = build_context(cfg, alpn)
    except (ssl.SSLError, OSError) as e:
        raise TlsError("cert", "invalid", f"{cfg.cert}: {e}") from None
    again = [read_pem(f, p) for f, p in files(cfg)]
    if again != [cert_pem, key_pem, *([ca_pem] if ca_pem is not None else [])]:
        raise Changing()
    subject = leaf.subject.rfc4514_string()
    return Material(
        ctx, cert_pem, key_pem, ca_pem, leaf.serial_number, subject,
        leaf.not_valid_after_utc.timestamp(), sig,
    )  # fmt: skip


def identity(peercert: Mapping[str, Any] | None) -> str:
    """The client identity of a verified peer certificate (`SSLObject.getpeercert()`): first
    URI SAN, else first DNS SAN, else the subject CN; "" without one."""
    if not peercert:
        return ""
    sans = peercert.get("subjectAltName", ())
    for kind in ("URI", "DNS"):
        for k, v in sans:
            if k == kind and v:
                return str(v)[:MAX_IDENTITY]
    for rdn in peercert.get("subject", ()):
        for k, v in rdn:
            if k == "commonName" and v:
                return str(v)[:MAX_IDENTITY]
    return ""


def grpc_identity(auth: Mapping[str, Iterable[bytes]]) -> str:
    """The same rule over a grpc `auth_context()` (x509 properties of a verified peer)."""
    for prop in ("peer_uri", "peer_dns", "x509_common_name"):
        for value in auth.get(prop, ()):
            return value.decode("utf-8", "replace")[:MAX_IDENTITY]
    return ""
