"""TLS of the simulated backend's HTTP and gRPC listeners (`--tls-cert/--tls-key`, and
`--tls-client-ca` to require client certificates): a peer for Sluice's upstream TLS."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from gateway.tls.local import backend_context, backend_grpc_credentials


@dataclass(frozen=True)
class ServerTls:
    """PEM files of the simulated backend's TLS listeners."""

    cert: str
    key: str
    client_ca: str | None = None  # set: clients must present a certificate this CA signed

    def context(self) -> ssl.SSLContext:
        """The HTTP listener's context."""
        return backend_context(self.cert, self.key, self.client_ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The gRPC listener's credentials."""
        return backend_grpc_credentials(self.cert, self.key, self.client_ca)
