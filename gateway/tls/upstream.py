"""TLS toward backends: one client context per backend `tls` section, built when the policy is
loaded (the files are read then, never per request or per connection) and shared by the HTTP
pool, the health checks and the gRPC channels of that backend's members.

`ClientTls.key` fingerprints the settings and the bytes of the files: the HTTP pool and the
gRPC channels key their connections by it (`Endpoint.upstream_key`), so a changed `tls` section
opens new connections while the old ones drain. Verification is on unless the policy says
`insecure_skip_verify` (HTTP only: grpcio has no such switch); a failed handshake is
`UpstreamTlsError` (502 / UNAVAILABLE, outcome `upstream_tls_error`), never a plaintext retry.
Key material is never logged: only file names and OpenSSL's reason.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from gateway.errors import TlsError, UpstreamTlsError
from gateway.tls.files import read_pem

if TYPE_CHECKING:
    from gateway.policy.backends import UpstreamTls

log = logging.getLogger("sluice.upstream.tls")

FAILURE_LOG_S = 10.0  # a member's handshake failures are logged at most this often
MAX_LOGGED = 1024  # members remembered for that


@dataclass(frozen=True, eq=False, slots=True)
class ClientTls:
    """What one backend's `tls` section became: the SSLContext of its HTTP connections and
    HTTP health checks, the credentials of its gRPC channels, and the name checked."""

    key: str  # fingerprint of the settings and the files' bytes
    context: ssl.SSLContext
    server_name: str | None  # SNI and the name verified; None: each endpoint's host
    grpc_credentials: grpc.ChannelCredentials
    verify: bool
    _logged: dict[str, float] = field(default_factory=dict, repr=False)

    def server_hostname(self, host: str) -> str:
        return self.server_name or host

    def grpc_options(self) -> tuple[tuple[str, str], ...]:
        """Channel options naming the server: gRPC checks the target's host otherwise."""
        if self.server_name is None:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),)

    def failed(self, address: str, reason: str) -> None:
        """Log a failed handshake with `address`, at most once per FAILURE_LOG_S per member."""
        now = time.monotonic()
        last = self._logged.get(address)
        if last is not None and now - last < FAILURE_LOG_S:
            return
        if len(self._logged) >= MAX_LOGGED:
            self._logged.clear()
        self._logged[address] = now
        log.warning("upstream TLS with %s failed: %s", address, reason)


def tls_reason(e: BaseException) -> str:
    """A short, key-free reason for a failed handshake (what the access log and 502 carry)."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {e.verify_message}"
    if isinstance(e, ssl.SSLError):
        return f"handshake failed: {e.reason or e.strerror or e}"
    return f"handshake failed: {e}"


# How grpc core words a failed handshake of our own channel in an UNAVAILABLE status's details:
# "Tls handshake failed (TSI_PROTOCOL_FAILURE): ... CERTIFICATE_VERIFY_FAILED: unable to get local
# issuer certificate", "Custom verification check failed with error: UNAUTHENTICATED: Hostname
# Verification Check failed." (grpcio 1.85).
GRPC_TLS_MARKERS = ("handshake failed", "CERTIFICATE_VERIFY_FAILED", "verification check failed")


def grpc_tls_reason(details: str) -> str:
    """The part of grpc core's details that says why a handshake failed, without the "failed
    to connect to all addresses; last error: UNKNOWN: ipv4:...:" preamble (else `details`)."""
    for marker in GRPC_TLS_MARKERS:
        i = details.find(marker)
        if i >= 0:
            start = details.rfind(": ", 0, i)
            return details[start + 2 if start >= 0 else 0 :].removesuffix(": OK")
    return details


def handshake_failed(tls: ClientTls | None, address: str, e: BaseException) -> UpstreamTlsError:
    """The error a failed handshake with `address` raises (its reason logged, rate-limited)."""
    reason = tls_reason(e)
    if tls is not None:
        tls.failed(address, reason)
    return UpstreamTlsError(f"TLS with {address}: {reason}")


def _no_password() -> str:
    raise TlsError("key", "invalid", "the key is encrypted: give Sluice an unencrypted key file")


def client_tls(s: UpstreamTls) -> ClientTls:
    """The contexts of these settings, built from their files once and kept with them (the
    loader builds them first; everything later shares them). Raises TlsError."""
    built = s.built()
    if isinstance(built, ClientTls):
        return built
    client = load_client_tls(s)
    s.keep(client)
    return client


def load_client_tls(s: UpstreamTls) -> ClientTls:
    """Read the files of `s` and build its contexts; raises TlsError (`field`: the setting at
    fault)."""
    ca = read_pem("ca", s.ca) if s.ca is not None else None
    cert = read_pem("cert", s.cert) if s.cert is not None else None
    key = read_pem("key", s.key) if s.key is not None else None
    cadata = None
    if ca is not None:
        if b"-----BEGIN CERTIFICATE-----" not in ca:
            raise TlsError("ca", "invalid", f"{s.ca} holds no PEM certificate")
        cadata = ca.decode("ascii", errors="replace")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=cadata)
    except ssl.SSLError as e:
        msg = f"{s.ca}: not a usable CA file ({e.reason or e})"
        raise TlsError("ca", "invalid", msg) from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])  # the pool speaks HTTP/1.1 only
    if s.insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if s.cert is not None and s.key is not None:
        if cert is not None and b"-----BEGIN CERTIFICATE-----" not in cert:
            raise TlsError("cert", "invalid", f"{s.cert} holds no PEM certificate")
        if key is not None and b"PRIVATE KEY-----" not in key:
            raise TlsError("key", "invalid", f"{s.key} holds no PEM private key")
        try:
            ctx.load_cert_chain(s.cert, s.key, password=_no_password)
        except ssl.SSLError as e:
            msg = f"{s.key} does not match the certificate in {s.cert} ({e.reason})"
            raise TlsError("key", "mismatch", msg) from None
        except OSError as e:  # replaced between the two reads
            raise TlsError(
                "cert", "unreadable", f"cannot read {s.cert}: {e.strerror or e}"
            ) from None
    digest = hashlib.sha256(s.model_dump_json().encode())
    for blob in (ca, cert, key):
        digest.update(hashlib.sha256(blob or b"").digest())
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
    return ClientTls(digest.hexdigest()[:16], ctx, s.server_name, creds, not s.insecure_skip_verify)
