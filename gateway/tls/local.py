"""The contexts of Sluice's own tools, not of the gateway: the simulated backend's TLS listeners
(a peer for Sluice's upstream TLS, `sluice mock-backend --tls-cert/--tls-key`) and the
readiness probe `sluice bench` sends to the processes it started."""

from __future__ import annotations

import ssl

import grpc


def backend_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The simulated backend's HTTP listener: `cert`/`key`, and with `client_ca` clients must
    present a certificate that CA signed."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def backend_grpc_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """The simulated backend's gRPC listener, as `backend_context`."""
    ca = _read(client_ca) if client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def probe_context() -> ssl.SSLContext:
    """A client context that does not verify: only for probing the readiness of a process
    started on this machine with a private CA (`sluice bench`), never toward a backend."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
