"""Verification keys: a JWKS document → a `KeySet` of public keys each bound to one algorithm
family, and an HMAC secret from the environment or a file.

Keys are parsed by PyJWT (`from_jwk`, on `cryptography`); this module decides which keys are
acceptable (RFC 8725 §3.1: a key is used with one algorithm). A document is refused whole, so the
previous set stays in force, when it is not a JSON object with a `keys` list, holds a symmetric
(`oct`) or private key, a weak RSA key (< 2048 bits), a key whose `alg` does not fit its type or
curve, a repeated `kid`, or no usable key at all. Keys marked for encryption (`use: enc`, or
`key_ops` without `verify`) and key types Sluice does not verify with are skipped. `x5c`, `x5u`,
`jku` and other members are never used.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jwt.algorithms import ECAlgorithm, HMACAlgorithm, OKPAlgorithm, RSAAlgorithm
from jwt.exceptions import InvalidKeyError

from gateway.errors import JwksInvalid, PolicyError
from gateway.policy.auth import SecretSource

MIN_RSA_BITS = 2048
MAX_KEYS = 64
MAX_KID = 256  # characters; a longer `kid` in a token is refused without a lookup
MAX_SECRET_BYTES = 4096

RSA_ALGS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"})
EC_ALG_OF_CURVE = {"P-256": "ES256", "P-384": "ES384", "P-521": "ES512"}
OKP_CURVES = frozenset({"Ed25519", "Ed448"})
HMAC_MIN_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}  # RFC 7518 §3.2: ≥ the hash size
_PRIVATE = ("d", "p", "q", "dp", "dq", "qi", "oth", "k")


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Duplicate("duplicate member name")
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(raw: bytes) -> Any:
    """RFC 8259 JSON from UTF-8 bytes: no BOM, no NaN/Infinity, no repeated member names (a
    parser differential between Sluice and the backend is how claims get smuggled). Raises
    ValueError (RecursionError for absurd nesting)."""
    text = raw.decode("utf-8")  # strict: invalid UTF-8 raises UnicodeDecodeError (a ValueError)
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


@dataclass(frozen=True, slots=True, eq=False)
class VerifyKey:
    """One public key and the algorithm family it may verify."""

    kid: str | None
    kty: str  # RSA | EC | OKP
    crv: str  # "" for RSA
    alg: str | None  # as published; None: bound to the provider's first fitting algorithm
    key: Any  # a cryptography public key object
    thumb: str  # sha256 of the canonical public JWK: equal thumb, same key

    def fits(self, alg: str) -> bool:
        """Whether `alg` can be used with this key's type and curve at all."""
        if self.kty == "RSA":
            return alg in RSA_ALGS
        if self.kty == "EC":
            return EC_ALG_OF_CURVE.get(self.crv) == alg
        return alg == "EdDSA"

    def bound_alg(self, allowed: tuple[str, ...]) -> str | None:
        """The one algorithm this key verifies for a provider allowing `allowed`, or None."""
        if self.alg is not None:
            return self.alg if self.alg in allowed else None
        for a in allowed:
            if self.fits(a):
                return a
        return None


@dataclass(frozen=True, slots=True, eq=False)
class KeySet:
    by_kid: Mapping[str, VerifyKey]
    no_kid: tuple[VerifyKey, ...]  # keys published without a `kid`
    fingerprint: str  # changes iff a key was added, removed or changed
    skipped: int = 0  # entries ignored (encryption keys, unknown types)
    thumbs: frozenset[str] = field(default_factory=frozenset)

    def __len__(self) -> int:
        return len(self.by_kid) + len(self.no_kid)

    def find(self, kid: str | None, alg: str, allowed: tuple[str, ...]) -> VerifyKey | None:
        """The key a token names; without a `kid`, the only key bound to its `alg`."""
        if kid is not None:
            k = self.by_kid.get(kid)
            return k if k is not None and k.bound_alg(allowed) == alg else None
        found = [k for k in (*self.by_kid.values(), *self.no_kid) if k.bound_alg(allowed) == alg]
        return found[0] if len(found) == 1 else None


def _thumb(jwk: Mapping[str, Any]) -> str:
    public = {k: v for k, v in jwk.items() if k in ("kty", "crv", "n", "e", "x", "y", "alg")}
    return hashlib.sha256(json.dumps(public, sort_keys=True).encode()).hexdigest()


def _parse_key(jwk: Mapping[str, Any]) -> VerifyKey | None:
    """A usable key, None for one to skip; raises JwksInvalid for one that spoils the set."""
    kty = jwk.get("kty")
    kid = jwk.get("kid")
    alg = jwk.get("alg")
    if kid is not None and (type(kid) is not str or not kid or len(kid) > MAX_KID):
        raise JwksInvalid("a key has a bad `kid`")
    if alg is not None and type(alg) is not str:
        raise JwksInvalid("a key has a bad `alg`")
    use, ops = jwk.get("use"), jwk.get("key_ops")
    if (use is not None and use != "sig") or (type(ops) is list and "verify" not in ops):
        return None
    if kty == "oct":
        raise JwksInvalid("a symmetric (oct) key in a public key set")
    if kty not in ("RSA", "EC", "OKP"):
        return None
    if any(p in jwk for p in _PRIVATE):
        raise JwksInvalid("a private key in a public key set")
    crv = jwk.get("crv", "") if kty != "RSA" else ""
    key: Any
    try:
        if kty == "RSA":
            key = RSAAlgorithm.from_jwk(dict(jwk))
            if key.key_size < MIN_RSA_BITS:
                raise JwksInvalid(f"an RSA key of {key.key_size} bits (< {MIN_RSA_BITS})")
            if alg is not None and alg not in RSA_ALGS:
                raise JwksInvalid(f"an RSA key marked {alg!r}")
        elif kty == "EC":
            if crv not in EC_ALG_OF_CURVE:
                return None  # e.g. secp256k1: not a curve Sluice verifies with
            key = ECAlgorithm.from_jwk(dict(jwk))
            if alg is not None and alg != EC_ALG_OF_CURVE[crv]:
                raise JwksInvalid(f"an EC {crv} key marked {alg!r}")
        else:
            if crv not in OKP_CURVES:
                return None
            key = OKPAlgorithm.from_jwk(dict(jwk))
            if alg is not None and alg not in ("EdDSA", "Ed25519", "Ed448"):
                raise JwksInvalid(f"an OKP key marked {alg!r}")
            alg = "EdDSA" if alg is not None else None
    except (InvalidKeyError, ValueError, TypeError, KeyError, binascii.Error):
        raise JwksInvalid(f"an unreadable {kty} key") from None
    if hasattr(key, "private_numbers"):
        raise JwksInvalid("a private key in a public key set")
    return VerifyKey(kid, str(kty), str(crv), alg, key, _thumb(jwk))


def parse_jwks(raw: bytes, previous: KeySet | None = None) -> KeySet:
    """A KeySet from a JWKS document, or JwksInvalid. Keys equal to ones in `previous` are
    reused as objects (a refresh that changes nothing keeps verified tokens valid)."""
    try:
        doc = strict_json(raw)
    except (ValueError, RecursionError):
        raise JwksInvalid("not JSON") from None
    if type(doc) is not dict or type(doc.get("keys")) is not list:
        raise JwksInvalid("not a JWKS (an object with a `keys` list)")
    entries = doc["keys"]
    if len(entries) > MAX_KEYS:
        raise JwksInvalid(f"more than {MAX_KEYS} keys")
    old: dict[str, VerifyKey] = {}
    if previous is not None:
        old = {k.thumb + (k.kid or ""): k for k in (*previous.by_kid.values(), *previous.no_kid)}
    by_kid: dict[str, VerifyKey] = {}
    no_kid: list[VerifyKey] = []
    skipped = 0
    for jwk in entries:
        if type(jwk) is not dict:
            raise JwksInvalid("a key is not an object")
        k = _parse_key(jwk)
        if k is None:
            skipped += 1
            continue
        k = old.get(k.thumb + (k.kid or ""), k)
        if k.kid is None:
            no_kid.append(k)
        elif k.kid in by_kid:
            raise JwksInvalid(f"two keys with kid {k.kid[:64]!r}")
        else:
            by_kid[k.kid] = k
    if not by_kid and not no_kid:
        raise JwksInvalid("no usable signing key")
    thumbs = frozenset(k.thumb + "/" + (k.kid or "") for k in (*by_kid.values(), *no_kid))
    fingerprint = hashlib.sha256("\n".join(sorted(thumbs)).encode()).hexdigest()[:16]
    return KeySet(by_kid, tuple(no_kid), fingerprint, skipped, thumbs)


def _looks_public(secret: bytes) -> bool:
    """A secret that is in fact a public key (PEM, ssh, DER, a JWK) is how HS256-with-the-
    public-key forgeries get accepted (CVE-2022-29217): refuse it as an HMAC secret."""
    s = secret.strip()
    if s.startswith((b"-----BEGIN", b"ssh-", b"ecdsa-sha2-", b"{")):
        return True
    try:
        HMACAlgorithm(HMACAlgorithm.SHA256).prepare_key(secret)
    except InvalidKeyError:
        return True
    return False


def load_secret(src: SecretSource, where: str, algorithms: tuple[str, ...]) -> bytes:
    """The HMAC secret a provider names, checked; PolicyError (never the secret) if unusable."""
    if src.env is not None:
        value = os.environ.get(src.env)
        if value is None:
            raise PolicyError([f"{where}: environment variable {src.env} is not set"])
        raw = value.encode()
    else:
        assert src.file is not None
        try:
            with Path(src.file).open("rb") as f:
                raw = f.read(MAX_SECRET_BYTES + 1)
        except OSError as e:
            raise PolicyError([f"{where}: cannot read {src.file}: {e.strerror or e}"]) from None
        if len(raw) > MAX_SECRET_BYTES:
            raise PolicyError([f"{where}: {src.file} is larger than {MAX_SECRET_BYTES} bytes"])
        raw = raw.rstrip(b"\r\n")
    if src.encoding != "raw":
        try:
            text = raw.strip() + b"=" * (-len(raw.strip()) % 4)
            alt = b"-_" if src.encoding == "base64url" else None
            raw = base64.b64decode(text, altchars=alt, validate=True)
        except (binascii.Error, ValueError):
            raise PolicyError([f"{where}: the secret is not valid {src.encoding}"]) from None
    need = max(HMAC_MIN_BYTES[a] for a in algorithms)
    if len(raw) < need:
        raise PolicyError([f"{where}: the secret is {len(raw)} bytes, {need} needed"])
    if _looks_public(raw):
        raise PolicyError([f"{where}: the secret looks like a public key, not an HMAC secret"])
    return raw
