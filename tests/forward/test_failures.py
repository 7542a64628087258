"""The upstream-failure table: a failed TLS handshake has its own row (502 / UNAVAILABLE,
outcome and metric kind of its own), on both protocols."""

from __future__ import annotations

import pytest

from gateway.core.outcome import Outcome
from gateway.core.verdict import GRPC_INTERNAL, GRPC_UNAVAILABLE
from gateway.errors import UpstreamConnectError, UpstreamTimeout, UpstreamTlsError
from gateway.forward.failures import CONNECT, TIMEOUT, TLS, failure_for, grpc_failure
from gateway.registry.member import Result, classify
from gateway.tls.upstream import grpc_tls_reason

# What grpcio 1.85 reports when Sluice's own channel fails its handshake.
UNKNOWN_CA = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:4000: Tls handshake "
    "failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
    "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK"
)
WRONG_NAME = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:4000: Custom "
    "verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed."
)


def test_a_failed_handshake_is_its_own_row() -> None:
    assert failure_for(UpstreamTlsError("TLS with a:1: certificate verify failed")) is TLS
    assert failure_for(UpstreamConnectError("refused")) is CONNECT
    assert failure_for(UpstreamTimeout("connect")) is TIMEOUT  # a handshake that never ends
    assert (TLS.http_status, TLS.grpc_status, TLS.outcome) == (
        502,
        GRPC_UNAVAILABLE,
        Outcome.UPSTREAM_TLS,
    )
    assert TLS.error_type == "upstream_tls_error" and TLS.kind == "tls"
    assert Outcome.UPSTREAM_TLS.upstream_failed  # breakers and outlier ejection count it


@pytest.mark.parametrize(
    ("code", "details", "tls", "row", "reason"),
    [
        (GRPC_UNAVAILABLE, UNKNOWN_CA, True, TLS, "Tls handshake failed (TSI_PROTOCOL_FAILURE)"),
        (GRPC_UNAVAILABLE, WRONG_NAME, True, TLS, "Custom verification check failed"),
        (GRPC_UNAVAILABLE, UNKNOWN_CA, False, None, ""),  # a plaintext backend's own words
        (GRPC_UNAVAILABLE, "Socket closed", True, None, ""),
        (GRPC_INTERNAL, UNKNOWN_CA, True, None, ""),
    ],
)
def test_grpc_statuses_of_a_failed_handshake(
    code: int, details: str, tls: bool, row: object, reason: str
) -> None:
    assert grpc_failure(code, details, tls) is row
    if reason:
        assert grpc_tls_reason(details).startswith(reason)
        assert not grpc_tls_reason(details).endswith(": OK")


def test_breakers_blame_the_backend_for_a_failed_handshake() -> None:
    assert classify(Outcome.UPSTREAM_TLS, 502, None) is Result.FAILED
    assert classify(Outcome.UPSTREAM_TLS, 0, GRPC_UNAVAILABLE) is Result.FAILED
