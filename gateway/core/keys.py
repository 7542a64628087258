"""(compiled) Limit keys, compiled once at policy load into one extractor function per rule. Pure.

A rule's `key` is a list of parts: `claim:NAME` (a verified JWT claim), `header:NAME` (request
header or gRPC metadata), `source_ip`, `client_cert` (the verified mTLS client certificate's
identity, see `RequestInfo.client_cert`), `route` (the matched route's name), `model` (the HTTP
body's `model`). The extractor joins the parts' values with "|" (a single part is its value
as is, the common and cheapest case). A part the request does not carry (no such claim or
header, no body model) counts as "-": every request without it shares that one bucket,
rather than escaping the limit. Values are cut at `MAX_PART` characters, and a header that
carries a credential (`authorization`, `x-api-key`, ...) is replaced by a short SHA-256 digest so
that no secret is kept in memory maps, Redis keys, logs or /admin/state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from gateway.core.request import RequestInfo

MAX_PART: Final = 128
MISSING: Final = "-"
SECRET_HEADERS: Final = frozenset(
    {"authorization", "proxy-authorization", "cookie", "x-api-key", "api-key"}
)


KeyFn = Callable[[RequestInfo, Mapping[str, Any] | None, str | None, str | None], str]


def source_ip(peer: str) -> str:
    """The address part of a peer: HTTP gives "1.2.3.4", gRPC "ipv4:1.2.3.4:5678" or
    "ipv6:[::1]:5678"."""
    if peer.startswith("ipv4:"):
        return peer[5:].rpartition(":")[0] or peer[5:]
    if peer.startswith("ipv6:"):
        rest = peer[5:]
        if rest.startswith("["):
            return rest[1 : rest.find("]")] if "]" in rest else rest
        return rest
    return peer or MISSING


def digest(value: str) -> str:
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:16]


def _claim(name: str) -> KeyFn:
    def part(
        info: RequestInfo, claims: Mapping[str, Any] | None, r: str | None, m: str | None
    ) -> str:
        v = claims.get(name) if claims is not None else None
        if v is None:
            return MISSING
        s = v if isinstance(v, str) else str(v)
        return s[:MAX_PART] if s else MISSING

    return part


def _header(name: str) -> KeyFn:
    lower = name.lower()
    secret = lower in SECRET_HEADERS

    def part(
        info: RequestInfo, claims: Mapping[str, Any] | None, r: str | None, m: str | None
    ) -> str:
        v = info.headers.get(lower)
        if not v:
            return MISSING
        return digest(v) if secret else v[:MAX_PART]

    return part


def _source_ip(
    info: RequestInfo, claims: Mapping[str, Any] | None, r: str | None, m: str | None
) -> str:
    peer = info.peer
    if peer and not peer.startswith("ipv"):
        return peer  # HTTP: the address itself
    return source_ip(peer)


def _client_cert(
    info: RequestInfo, claims: Mapping[str, Any] | None, r: str | None, m: str | None
) -> str:
    return info.client_cert[:MAX_PART] or MISSING


def _route(
    info: RequestInfo, claims: Mapping[str, Any] | None, r: str | None, m: str | None
) -> str:
    return r or MISSING


def _model(
    info: RequestInfo, claims: Mapping[str, Any] | None, r: str | None, m: str | None
) -> str:
    return m[:MAX_PART] if m else MISSING


def _everything(
    info: RequestInfo, claims: Mapping[str, Any] | None, r: str | None, m: str | None
) -> str:
    return "*"


def _part(spec: str) -> KeyFn:
    kind, _, name = spec.partition(":")
    if kind == "claim":
        return _claim(name)
    if kind == "header":
        return _header(name)
    if spec == "source_ip":
        return _source_ip
    if spec == "client_cert":
        return _client_cert
    if spec == "route":
        return _route
    if spec == "model":
        return _model
    raise ValueError(f"unknown key part {spec!r}")


def compile_key(parts: Sequence[str]) -> KeyFn:
    """One function from (info, claims, route, model) to the key string. An empty key is one
    bucket for every request ("*")."""
    fns = [_part(p) for p in parts]
    if not fns:
        return _everything
    if len(fns) == 1:
        return fns[0]

    def joined(
        info: RequestInfo, claims: Mapping[str, Any] | None, r: str | None, m: str | None
    ) -> str:
        return "|".join([f(info, claims, r, m) for f in fns])

    return joined


def needs(parts: Sequence[str]) -> frozenset[str]:
    """Which late facts a key needs: "route" (known once routed), "model" (the body phase)."""
    return frozenset(p for p in parts if p in ("route", "model"))
