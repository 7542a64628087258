"""Token verification: compact JWS → (provider, verified claims), or the reason it is refused.

Two steps, so that the caller can fetch keys in between without holding anything but values:

1. `inspect(token)`: the structure, before any key is touched. Exactly three base64url
   segments (no padding, no other characters), a JSON header and payload (strict: no repeated
   members, no NaN), `alg` in the provider's allowlist (the header never picks an algorithm
   outside it; `none` is never registered), no `crit` (Sluice implements no extension, RFC 7515
   §4.1.11), no `b64`, a bounded string `kid`, the provider picked by the exact `iss`. The
   header's `jku`, `x5u`, `jwk` and `x5c` are never read.
2. `finish(token, inspected, key)`: the signature, by PyJWT's PyJWS with the one algorithm the
   key is bound to, then the claims (`gateway.core.jwtclaims`).
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from jwt.api_jws import PyJWS
from jwt.exceptions import PyJWTError

from gateway.auth.keys import MAX_KID, VerifyKey, strict_json
from gateway.core import jwtclaims as jc
from gateway.policy.auth import ASYMMETRIC_ALGORITHMS, HMAC_ALGORITHMS

if TYPE_CHECKING:
    from gateway.auth.jwks import JwksSource

# Only these algorithms exist for the verifier: "none" is not registered, so it cannot be chosen.
_JWS = PyJWS(
    algorithms=[*ASYMMETRIC_ALGORITHMS, *HMAC_ALGORITHMS],
    options={"verify_signature": True, "enforce_minimum_key_length": True},
)
_COMPACT = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
NO_EXP_CACHE_S = 600.0  # a token without `exp` (require_exp: false) is re-verified this often


@dataclass(frozen=True, slots=True, eq=False)
class Provider:
    """A policy provider compiled for verification (the secret never leaves this object)."""

    name: str
    rules: jc.ClaimRules
    algorithms: tuple[str, ...]
    typ: str | None  # required `typ` header, lower-case, without "application/"
    secret: bytes | None  # HS* providers
    jwks: JwksSource | None  # the others
    forward: tuple[tuple[str, str], ...]  # (claim, lower-case header)

    def __repr__(self) -> str:  # never print the secret
        return f"Provider({self.name!r})"


@dataclass(frozen=True, slots=True)
class Inspected:
    provider: Provider
    alg: str
    kid: str | None
    claims: dict[str, Any]  # not yet verified
    payload: bytes


@dataclass(frozen=True, slots=True)
class Verified:
    provider: Provider
    claims: Mapping[str, Any]  # read-only view of the verified payload
    subject: str
    expires: float  # wall-clock time the token stops being acceptable


@dataclass(frozen=True, slots=True)
class Failure:
    reason: str  # a gateway.core.jwtclaims reason class
    provider: str = ""  # the provider named by `iss`, when one matched


def _segment(seg: str) -> tuple[dict[str, Any] | None, bytes]:
    try:
        raw = base64.urlsafe_b64decode(seg + "=" * (-len(seg) % 4))
        doc = strict_json(raw)
    except (ValueError, binascii.Error, RecursionError):
        return None, b""
    return (doc if type(doc) is dict else None), raw


class Verifier:
    """The providers of one policy, by issuer."""

    def __init__(self, providers: list[Provider], wall: Any = time.time) -> None:
        self.providers = tuple(providers)
        self._by_issuer = {p.rules.issuer: p for p in providers}
        self._wall = wall

    def inspect(self, token: str) -> Inspected | Failure:
        if not _COMPACT.fullmatch(token):
            return Failure(jc.MALFORMED)
        h64, p64, _ = token.split(".")
        header, _raw = _segment(h64)
        claims, payload = _segment(p64)
        if header is None or claims is None:
            return Failure(jc.MALFORMED)
        iss = claims.get("iss")
        provider = self._by_issuer.get(iss) if type(iss) is str else None
        if provider is None:
            return Failure(jc.UNKNOWN_ISSUER)
        alg, kid = header.get("alg"), header.get("kid")
        if (
            type(alg) is not str
            or alg not in provider.algorithms
            or "crit" in header
            or "b64" in header
            or (kid is not None and (type(kid) is not str or not kid or len(kid) > MAX_KID))
        ):
            return Failure(jc.BAD_HEADER, provider.name)
        if provider.typ is not None:
            typ = header.get("typ")
            if type(typ) is not str or typ.lower().removeprefix("application/") != provider.typ:
                return Failure(jc.BAD_HEADER, provider.name)
        return Inspected(provider, alg, kid, claims, payload)

    def finish(self, token: str, insp: Inspected, key: VerifyKey | bytes) -> Verified | Failure:
        p = insp.provider
        material = key if isinstance(key, bytes) else key.key
        try:
            out = _JWS.decode_complete(token, key=material, algorithms=[insp.alg])
        except PyJWTError:
            return Failure(jc.BAD_SIGNATURE, p.name)
        except (ValueError, TypeError):  # a key that cannot verify this signature shape
            return Failure(jc.BAD_SIGNATURE, p.name)
        if out["payload"] != insp.payload:  # the same bytes both parsers saw, or nothing
            return Failure(jc.MALFORMED, p.name)
        claims = insp.claims
        now = self._wall()
        reason = jc.check_claims(claims, p.rules, now)
        if reason:
            return Failure(reason, p.name)
        expires = jc.valid_until(claims, p.rules.leeway)
        if expires == float("inf"):
            expires = now + NO_EXP_CACHE_S
        sub = claims.get("sub")
        return Verified(p, MappingProxyType(claims), sub if type(sub) is str else "", expires)
