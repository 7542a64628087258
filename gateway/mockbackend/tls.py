"""TLS of the simulated backend's HTTP and gRPC listeners (`--tls-cert/--tls-key`, and
`--tls-client-ca` to require client certificates): a peer for Sluice's upstream TLS."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class ServerTls:
    """PEM files of the simulated backend's TLS listeners."""

    cert: str
    key: str
    client_ca: str | None = None  # set: clients must present a certificate this CA signed

    def context(self) -> ssl.SSLContext:
        """The HTTP listener's context."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The gRPC listener's credentials."""
        ca = _read(self.client_ca) if self.client_ca is not None else None
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
