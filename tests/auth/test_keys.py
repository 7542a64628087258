"""gateway.auth.keys: which JWKS documents and HMAC secrets are accepted, by table."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.auth.keys import load_secret, parse_jwks
from gateway.errors import JwksInvalid, PolicyError
from gateway.policy.auth import SecretSource
from tests.auth import mint

RSA = mint.rsa_key("r1")
EC = mint.ec_key("e1")
EC384 = mint.ec_key("e384", "ES384")
ED = mint.ed_key("ed1")
WEAK = mint.rsa_key("weak", bits=1024)


def doc(*jwks: dict[str, Any]) -> bytes:
    return json.dumps({"keys": list(jwks)}).encode()


def test_a_good_set_binds_each_key() -> None:
    ks = parse_jwks(doc(RSA.jwk(), EC.jwk(), EC384.jwk(), ED.jwk()))
    assert len(ks) == 4
    allowed = ("RS256", "PS256", "ES256", "ES384", "EdDSA")
    assert ks.find("r1", "RS256", allowed) is not None
    assert ks.find("r1", "PS256", allowed) is None  # marked RS256: bound to it
    assert ks.find("e1", "ES256", allowed) is not None
    assert ks.find("e1", "ES384", allowed) is None  # P-256 verifies ES256 only
    assert ks.find("e384", "ES256", allowed) is None
    assert ks.find("ed1", "EdDSA", allowed) is not None
    assert ks.find("nope", "RS256", allowed) is None


def test_a_key_without_alg_takes_the_first_fitting_allowed_algorithm() -> None:
    ks = parse_jwks(doc(RSA.jwk(with_alg=False)))
    assert ks.find("r1", "PS256", ("PS256", "RS256")) is not None
    assert ks.find("r1", "RS256", ("PS256", "RS256")) is None
    assert ks.find("r1", "RS256", ("ES256", "RS256")) is not None


def test_no_kid_in_token_uses_the_only_fitting_key() -> None:
    jwk = RSA.jwk()
    del jwk["kid"]
    ks = parse_jwks(doc(jwk, EC.jwk()))
    assert ks.find(None, "RS256", ("RS256", "ES256")) is not None
    two = parse_jwks(doc(RSA.jwk(), mint.rsa_key("r2").jwk()))
    assert two.find(None, "RS256", ("RS256",)) is None  # ambiguous: refuse


def test_encryption_keys_and_unknown_types_are_skipped() -> None:
    enc = {**mint.rsa_key("enc").jwk(), "use": "enc"}
    ops = {**mint.rsa_key("ops").jwk(), "key_ops": ["encrypt"]}
    k1 = {"kty": "EC", "crv": "secp256k1", "x": "AA", "y": "AA", "kid": "k1"}
    ks = parse_jwks(doc(RSA.jwk(), enc, ops, k1, {"kty": "XYZ"}))
    assert len(ks) == 1 and ks.skipped == 4


def _private_rsa() -> dict[str, Any]:
    from jwt.algorithms import RSAAlgorithm

    return dict(json.loads(RSAAlgorithm.to_jwk(RSA.private)), kid="priv")


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("html", b"<html><body>login</body></html>"),
        ("empty keys", b'{"keys": []}'),
        ("no keys member", b'{"key": []}'),
        ("keys not a list", b'{"keys": {}}'),
        ("a list", b"[]"),
        ("not utf-8", b'{"keys": ["\xff"]}'),
        ("BOM", b'\xef\xbb\xbf{"keys": []}'),
        ("NaN", b'{"keys": [], "x": NaN}'),
        ("duplicate member", b'{"keys": [], "keys": []}'),
        ("deep", b'{"keys": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
        ("only encryption keys", doc({**RSA.jwk(), "use": "enc"})),
        ("oct key", doc(RSA.jwk(), {"kty": "oct", "k": "c2VjcmV0", "kid": "s"})),
        ("weak RSA", doc(RSA.jwk(), WEAK.jwk())),
        ("private RSA", doc(_private_rsa())),
        ("private EC", doc({**EC.jwk(), "d": "AAAA"})),
        ("RSA marked ES256", doc({**RSA.jwk(), "alg": "ES256"})),
        ("P-256 marked ES384", doc({**EC.jwk(), "alg": "ES384"})),
        ("wrong curve point", doc({**EC.jwk(), "crv": "P-384"})),
        ("duplicate kid", doc(RSA.jwk(), {**mint.rsa_key("r1").jwk()})),
        ("kid not a string", doc({**RSA.jwk(), "kid": 7})),
        ("kid too long", doc({**RSA.jwk(), "kid": "k" * 300})),
        ("garbage modulus", doc({**RSA.jwk(), "n": "!!"})),
        ("a key not an object", doc("RSA")),  # type: ignore[arg-type]
        ("too many keys", doc(*[{**RSA.jwk(), "kid": f"k{i}"} for i in range(65)])),
    ],
)
def test_refused_documents(name: str, body: bytes) -> None:
    with pytest.raises(JwksInvalid):
        parse_jwks(body)


def test_unchanged_keys_keep_their_objects_across_refreshes() -> None:
    first = parse_jwks(doc(RSA.jwk(), EC.jwk()))
    second = parse_jwks(doc(EC.jwk(), RSA.jwk(), mint.rsa_key("r2").jwk()), first)
    assert second.by_kid["r1"] is first.by_kid["r1"]
    assert first.thumbs <= second.thumbs and second.fingerprint != first.fingerprint
    third = parse_jwks(doc(EC.jwk()), second)
    assert not second.thumbs <= third.thumbs  # r1 went away


def test_secret_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T_SECRET", mint.HS_SECRET.decode())
    assert load_secret(SecretSource(env="T_SECRET"), "w", ("HS256",)) == mint.HS_SECRET
    f = tmp_path / "s"
    f.write_bytes(mint.HS_SECRET + b"\n")
    assert load_secret(SecretSource(file=str(f)), "w", ("HS256",)) == mint.HS_SECRET
    f.write_text(base64.b64encode(mint.HS_SECRET).decode())
    src = SecretSource(file=str(f), encoding="base64")
    assert load_secret(src, "w", ("HS256",)) == mint.HS_SECRET


@pytest.mark.parametrize(
    ("name", "secret", "message"),
    [
        ("short", b"x" * 31, "32 needed"),
        ("public key PEM", RSA.public_pem(), "public key"),
        ("JWK JSON", json.dumps(RSA.jwk()).encode(), "public key"),
        ("ssh key", b"ssh-ed25519 " + b"A" * 68, "public key"),
    ],
)
def test_unusable_secrets(
    name: str, secret: bytes, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("T_SECRET", secret.decode())
    with pytest.raises(PolicyError) as e:
        load_secret(SecretSource(env="T_SECRET"), "auth.providers[1].secret", ("HS256",))
    text = str(e.value)
    assert message in text and "auth.providers[1].secret" in text
    assert secret.decode()[:20] not in text  # the secret is never in the message


def test_missing_env_and_hs512_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("T_NOPE", raising=False)
    with pytest.raises(PolicyError, match="T_NOPE is not set"):
        load_secret(SecretSource(env="T_NOPE"), "w", ("HS256",))
    monkeypatch.setenv("T_SECRET", mint.HS_SECRET.decode())  # 40 bytes: enough for HS256 only
    with pytest.raises(PolicyError, match="64 needed"):
        load_secret(SecretSource(env="T_SECRET"), "w", ("HS256", "HS512"))
