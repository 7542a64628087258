from __future__ import annotations

from typing import Any

import pytest

from gateway.core.keys import compile_key, digest, needs, source_ip
from gateway.core.request import RequestInfo, Wire

INFO = RequestInfo(
    Wire.HTTP,
    "POST",
    "/v1/x",
    {"x-tenant": "acme", "authorization": "Bearer secret-token", "x-long": "a" * 500},
    peer="10.1.2.3",
)
CLAIMS: dict[str, Any] = {"tenant": "t-9", "tier": 2, "empty": ""}


@pytest.mark.parametrize(
    ("parts", "claims", "route", "model", "expected"),
    [
        ([], None, None, None, "*"),
        (["claim:tenant"], CLAIMS, None, None, "t-9"),
        (["claim:tier"], CLAIMS, None, None, "2"),
        (["claim:tenant"], None, None, None, "-"),  # no auth: one shared bucket, not unlimited
        (["claim:empty"], CLAIMS, None, None, "-"),
        (["header:X-Tenant"], None, None, None, "acme"),
        (["header:x-missing"], None, None, None, "-"),
        (["source_ip"], None, None, None, "10.1.2.3"),
        (["route"], None, "openai", None, "openai"),
        (["model"], None, None, "llama", "llama"),
        (["model"], None, None, None, "-"),
        (["claim:tenant", "model"], CLAIMS, None, "m", "t-9|m"),
        (["header:x-long"], None, None, None, "a" * 128),  # cut at MAX_PART
    ],
)
def test_key(parts: list[str], claims: Any, route: Any, model: Any, expected: str) -> None:
    assert compile_key(parts)(INFO, claims, route, model) == expected


def test_credential_headers_are_digested_never_kept() -> None:
    key = compile_key(["header:authorization"])(INFO, None, None, None)
    assert "secret" not in key and key == digest("Bearer secret-token")


@pytest.mark.parametrize(
    ("peer", "ip"),
    [
        ("10.0.0.1", "10.0.0.1"),
        ("ipv4:10.0.0.1:5555", "10.0.0.1"),
        ("ipv6:[::1]:5555", "::1"),
        ("ipv6:%5B::1%5D:5555", "%5B::1%5D:5555"),  # unknown shape: kept as is
        ("", "-"),
    ],
)
def test_source_ip(peer: str, ip: str) -> None:
    assert source_ip(peer) == ip


def test_needs() -> None:
    assert needs(["route", "claim:x", "model"]) == {"route", "model"}
    assert needs(["source_ip"]) == frozenset()


def test_client_cert_part() -> None:
    key = compile_key(["client_cert", "route"])
    with_cert = RequestInfo(Wire.GRPC, "POST", "/a.B/C", client_cert="spiffe://t/a" + "x" * 200)
    assert key(with_cert, None, "r", None) == "spiffe://t/a" + "x" * 116 + "|r"
    assert key(INFO, None, "r", None) == "-|r"  # no verified certificate: the shared bucket
