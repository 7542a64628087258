"""Tokens and keys for the tests, built by hand with `cryptography` only: independent of PyJWT and
of Sluice's verifier, so a bug shared by both cannot make a forged token look valid.

`jws(header, payload, key)` signs whatever header it is given (`alg` included), so the attack
tables can put any lie into a token; `raw(...)` assembles arbitrary segments.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

ISSUER = "https://login.example.com/"
AUDIENCE = "sluice"
HS_SECRET = b"sluice-test-hmac-secret-0123456789abcdef"  # 40 bytes
HS_ISSUER = "internal"

_HASH = {"256": hashes.SHA256, "384": hashes.SHA384, "512": hashes.SHA512}
_EC_SIZE = {"ES256": 32, "ES384": 48, "ES512": 66}


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def der(raw_sig: bytes) -> bytes:
    """A raw R‖S ECDSA signature re-encoded as DER (what JWS must not carry)."""
    half = len(raw_sig) // 2
    r, s = int.from_bytes(raw_sig[:half], "big"), int.from_bytes(raw_sig[half:], "big")
    return bytes(encode_dss_signature(r, s))


def resign(header: bytes, payload_b64: str, key: Key, alg: str = "RS256") -> str:
    """The b64 signature over a header given as raw bytes (for headers json.dumps cannot make)."""
    return b64(sign(alg, key, f"{b64(header)}.{payload_b64}".encode()))


def b64json(doc: Any) -> str:
    return b64(doc if isinstance(doc, bytes) else json.dumps(doc, separators=(",", ":")).encode())


def _uint(n: int, size: int | None = None) -> str:
    size = size or (n.bit_length() + 7) // 8
    return b64(n.to_bytes(size, "big"))


@dataclass
class Key:
    kid: str
    private: Any  # a cryptography private key, or bytes (HMAC)
    alg: str

    def jwk(self, with_alg: bool = True) -> dict[str, Any]:
        pub = self.private.public_key()
        out: dict[str, Any]
        if isinstance(pub, rsa.RSAPublicKey):
            nums = pub.public_numbers()
            out = {"kty": "RSA", "n": _uint(nums.n), "e": _uint(nums.e)}
        elif isinstance(pub, ec.EllipticCurvePublicKey):
            size = (pub.curve.key_size + 7) // 8
            crv = {256: "P-256", 384: "P-384", 521: "P-521"}[pub.curve.key_size]
            nums = pub.public_numbers()
            out = {"kty": "EC", "crv": crv, "x": _uint(nums.x, size), "y": _uint(nums.y, size)}
        else:
            raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            out = {"kty": "OKP", "crv": "Ed25519", "x": b64(raw)}
        out["kid"] = self.kid
        out["use"] = "sig"
        if with_alg:
            out["alg"] = self.alg
        return out

    def public_pem(self) -> bytes:
        return bytes(
            self.private.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )


def rsa_key(kid: str, alg: str = "RS256", bits: int = 2048) -> Key:
    return Key(kid, rsa.generate_private_key(public_exponent=65537, key_size=bits), alg)


def ec_key(kid: str, alg: str = "ES256") -> Key:
    curve = {"ES256": ec.SECP256R1(), "ES384": ec.SECP384R1(), "ES512": ec.SECP521R1()}[alg]
    return Key(kid, ec.generate_private_key(curve), alg)


def ed_key(kid: str) -> Key:
    return Key(kid, ed25519.Ed25519PrivateKey.generate(), "EdDSA")


def jwks(*keys: Key, with_alg: bool = True) -> dict[str, Any]:
    return {"keys": [k.jwk(with_alg) for k in keys]}


def sign(alg: str, key: Any, data: bytes) -> bytes:
    """The signature of `data` under `alg` with `key`, computed here, by hand."""
    if alg.startswith("HS"):
        secret = key if isinstance(key, bytes) else key.private
        return hmac.new(secret, data, getattr(hashlib, "sha" + alg[2:])).digest()
    priv = key.private if isinstance(key, Key) else key
    h = _HASH.get(alg[2:])
    if alg.startswith("RS"):
        return bytes(priv.sign(data, padding.PKCS1v15(), h()))
    if alg.startswith("PS"):
        pss = padding.PSS(mgf=padding.MGF1(h()), salt_length=h().digest_size)
        return bytes(priv.sign(data, pss, h()))
    if alg.startswith("ES"):
        r, s = decode_dss_signature(priv.sign(data, ec.ECDSA(h())))
        size = max(_EC_SIZE[alg], (priv.curve.key_size + 7) // 8)  # a swapped curve still fits
        return r.to_bytes(size, "big") + s.to_bytes(size, "big")
    if alg == "EdDSA":
        return bytes(priv.sign(data))
    raise ValueError(alg)


def claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    base: dict[str, Any] = {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": "user-1",
        "iat": now,
        "exp": now + 3600,  # cases are minted at collection: valid through a slow suite run
        "tenant": "acme",
        "tier": "gold",
    }
    for k, v in over.items():
        if v is DROP:
            base.pop(k, None)
        else:
            base[k] = v
    return base


DROP = object()


def jws(
    payload: dict[str, Any] | bytes,
    key: Key | bytes,
    alg: str | None = None,
    header: dict[str, Any] | None = None,
    sign_as: str | None = None,
) -> str:
    """A compact JWS. `alg` defaults to the key's; `header` replaces the default header
    (`alg`, `kid`, `typ`); `sign_as` signs with another algorithm than the header names."""
    alg = alg or (key.alg if isinstance(key, Key) else "HS256")
    h = header if header is not None else {"alg": alg, "typ": "JWT"}
    if header is None and isinstance(key, Key):
        h["kid"] = key.kid
    signing_input = f"{b64json(h)}.{b64json(payload)}".encode()
    sig = sign(sign_as or alg, key, signing_input)
    return f"{signing_input.decode()}.{b64(sig)}"


def raw(*segments: str) -> str:
    return ".".join(segments)
