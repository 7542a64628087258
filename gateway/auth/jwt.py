"""Token verification: compact JWS → (provider, verified claims), or the reason it is refused.

Two steps, so that the caller can fetch keys in between without holding anything but values:

1. `inspect(token)`: the structure, before any key is touched. Exactly three base64url
   segments in canonical form (no padding, no other characters), a JSON header and payload
   (strict: no repeated members, no NaN, UTF-8), `alg` in the provider's allowlist (the header
   never picks an algorithm outside it; `none` does not exist here), no `crit` (Sluice
   implements no extension, RFC 7515 §4.1.11), no `b64`, a bounded string `kid`, the provider
   picked by the exact `iss`. The header's `jku`, `x5u`, `jwk` and `x5c` are never read.
2. `finish(inspected, key)`: the signature, by PyJWT's algorithm object for the one algorithm
   the key is bound to (`prepare_key`, `check_key_length`, `verify`: PyJWT's RSA, RSA-PSS,
   ECDSA raw-signature and EdDSA code on `cryptography`), then the claims
   (`gateway.core.jwtclaims`).

Why not `PyJWS.decode_complete`: its base64url alphabet check is a Python loop over every
character, ~40 µs for an 800-byte token (measured), more than the RS256 signature check; the
compact form is checked here with one regular expression instead, as strictly.
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

from jwt.algorithms import Algorithm, HMACAlgorithm, get_default_algorithms
from jwt.exceptions import PyJWTError

from gateway.auth.keys import MAX_KID, VerifyKey, strict_json
from gateway.core import jwtclaims as jc
from gateway.policy.auth import ASYMMETRIC_ALGORITHMS

if TYPE_CHECKING:
    from gateway.auth.jwks import JwksSource


class Secret(bytes):
    """An HMAC secret already checked by `gateway.auth.keys.load_secret` (length, not a public
    key): PyJWT's per-token re-check (PEM, ssh, DER and JWK parsing) is skipped for it alone;
    any other bytes get the full check."""

    def __repr__(self) -> str:  # never the secret itself, whatever prints it
        return f"Secret({len(self)} bytes)"

    __str__ = __repr__


class _CheckedHMAC(HMACAlgorithm):
    def prepare_key(self, key: str | bytes) -> bytes:
        if type(key) is Secret:
            return bytes(key)
        return super().prepare_key(key)


# The only algorithms that exist for the verifier: "none" is not among them.
_DEFAULTS = get_default_algorithms()
ALGORITHMS: dict[str, Algorithm] = {a: _DEFAULTS[a] for a in ASYMMETRIC_ALGORITHMS}
ALGORITHMS |= {
    "HS256": _CheckedHMAC(HMACAlgorithm.SHA256),
    "HS384": _CheckedHMAC(HMACAlgorithm.SHA384),
    "HS512": _CheckedHMAC(HMACAlgorithm.SHA512),
}
_COMPACT = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
NO_EXP_CACHE_S = 600.0  # a token without `exp` (require_exp: false) is re-verified this often


def _b64(seg: str) -> bytes | None:
    """Canonical unpadded base64url (the alphabet is already checked), or None."""
    try:
        raw = base64.urlsafe_b64decode(seg + "=" * (-len(seg) % 4))
    except (ValueError, binascii.Error):
        return None
    if base64.urlsafe_b64encode(raw).rstrip(b"=") != seg.encode():
        return None  # stray trailing bits: two spellings of one token
    return raw


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
    jwks_spec: Any = None  # the JWKS parameters, applied when the policy goes live

    def __repr__(self) -> str:  # never print the secret
        return f"Provider({self.name!r})"


@dataclass(frozen=True, slots=True)
class Inspected:
    provider: Provider
    alg: str
    kid: str | None
    claims: dict[str, Any]  # not yet verified
    signing_input: bytes  # header.payload, as sent
    signature: bytes


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


def _segment(seg: str) -> dict[str, Any] | None:
    raw = _b64(seg)
    if raw is None:
        return None
    try:
        doc = strict_json(raw)
    except (ValueError, RecursionError):
        return None
    return doc if type(doc) is dict else None


class Verifier:
    """The providers of one policy, by issuer."""

    def __init__(self, providers: list[Provider], wall: Any = time.time) -> None:
        self.providers = tuple(providers)
        self._by_issuer = {p.rules.issuer: p for p in providers}
        self._wall = wall

    def inspect(self, token: str) -> Inspected | Failure:
        if not _COMPACT.fullmatch(token):
            return Failure(jc.MALFORMED)
        h64, p64, s64 = token.split(".")
        header, claims, signature = _segment(h64), _segment(p64), _b64(s64)
        if header is None or claims is None or signature is None:
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
        signing_input = token[: len(h64) + 1 + len(p64)].encode()
        return Inspected(provider, alg, kid, claims, signing_input, signature)

    def finish(self, insp: Inspected, key: VerifyKey | bytes) -> Verified | Failure:
        p = insp.provider
        material = key if isinstance(key, bytes) else key.key
        algo = ALGORITHMS[insp.alg]
        try:
            prepared = algo.prepare_key(material)
            ok = not algo.check_key_length(prepared) and algo.verify(
                insp.signing_input, prepared, insp.signature
            )
        except (PyJWTError, ValueError, TypeError):  # a key of another type, a bad shape
            ok = False
        if not ok:
            return Failure(jc.BAD_SIGNATURE, p.name)
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
