"""gateway.core.jwtclaims: claim checks, route requirements and header values, by table."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.core import jwtclaims as jc

NOW = 1_800_000_000.0
RULES = jc.ClaimRules("https://login.example.com/", frozenset({"sluice"}), leeway=60.0)


def claims(**over: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "iss": "https://login.example.com/",
        "aud": "sluice",
        "sub": "u",
        "iat": NOW - 10,
        "exp": NOW + 600,
    }
    for k, v in over.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return c


@pytest.mark.parametrize(
    ("name", "over", "reason"),
    [
        ("valid", {}, ""),
        ("exp just inside the leeway", {"exp": NOW - 59}, ""),
        ("exp at the leeway", {"exp": NOW - 60}, ""),
        ("exp just outside the leeway", {"exp": NOW - 61}, jc.EXPIRED),
        ("nbf 10 s ahead", {"nbf": NOW + 10}, ""),
        ("nbf just outside", {"nbf": NOW + 61}, jc.NOT_YET_VALID),
        ("iat just inside", {"iat": NOW + 59}, ""),
        ("iat just outside", {"iat": NOW + 61}, jc.ISSUED_IN_FUTURE),
        ("missing exp", {"exp": None}, jc.MISSING_EXP),
        ("exp string", {"exp": str(int(NOW + 600))}, jc.BAD_CLAIM),
        ("exp bool", {"exp": True}, jc.BAD_CLAIM),
        ("exp inf", {"exp": math.inf}, jc.BAD_CLAIM),
        ("exp nan", {"exp": math.nan}, jc.BAD_CLAIM),
        ("exp > 2^63", {"exp": 2**64}, jc.BAD_CLAIM),
        ("exp negative", {"exp": -1}, jc.EXPIRED),
        ("exp null", {"exp": "null"}, jc.BAD_CLAIM),
        ("exp float ok", {"exp": NOW + 0.5}, ""),
        ("nbf string", {"nbf": "0"}, jc.BAD_CLAIM),
        ("iat list", {"iat": [1]}, jc.BAD_CLAIM),
        ("issuer suffix", {"iss": "https://login.example.com/.evil"}, jc.UNKNOWN_ISSUER),
        ("issuer prefix", {"iss": "https://login.example.com"}, jc.UNKNOWN_ISSUER),
        ("issuer in a list", {"iss": ["https://login.example.com/"]}, jc.UNKNOWN_ISSUER),
        ("issuer missing", {"iss": None}, jc.UNKNOWN_ISSUER),
        ("aud missing", {"aud": None}, jc.AUDIENCE),
        ("aud wrong", {"aud": "other"}, jc.AUDIENCE),
        ("aud empty list", {"aud": []}, jc.AUDIENCE),
        ("aud list without ours", {"aud": ["a", "b"]}, jc.AUDIENCE),
        ("aud list with ours", {"aud": ["a", "sluice"]}, ""),
        ("aud not strings", {"aud": [1, "sluice"]}, jc.AUDIENCE),
        ("aud substring", {"aud": "sluic"}, jc.AUDIENCE),
        ("sub not a string", {"sub": 7}, jc.BAD_CLAIM),
    ],
)
def test_check_claims(name: str, over: dict[str, Any], reason: str) -> None:
    assert jc.check_claims(claims(**over), RULES, NOW) == reason, name


def test_audience_not_checked_when_none_configured() -> None:
    rules = jc.ClaimRules("https://login.example.com/", frozenset(), 60.0)
    assert jc.check_claims(claims(aud=None), rules, NOW) == ""


def test_exp_optional_when_not_required() -> None:
    rules = jc.ClaimRules("https://login.example.com/", frozenset({"sluice"}), 60.0, False)
    assert jc.check_claims(claims(exp=None), rules, NOW) == ""
    assert jc.valid_until(claims(exp=None), 60.0) == math.inf


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"iat": NOW, "exp": NOW + 3600}, ""),
        ({"iat": NOW, "exp": NOW + 3601}, jc.TOO_LONG_LIVED),
        ({"iat": None, "nbf": NOW, "exp": NOW + 3601}, jc.TOO_LONG_LIVED),
        ({"iat": None, "exp": NOW + 10}, jc.TOO_LONG_LIVED),  # no start: lifetime unknown
        ({"exp": None}, jc.MISSING_EXP),
    ],
)
def test_max_lifetime(over: dict[str, Any], reason: str) -> None:
    rules = jc.ClaimRules("https://login.example.com/", frozenset({"sluice"}), 60.0, True, 3600.0)
    assert jc.check_claims(claims(**over), rules, NOW) == reason


@pytest.mark.parametrize(
    ("value", "ok"),
    [("gold", True), ("bronze", False), (["x", "silver"], True), (["x"], False), ([], False),
     (None, False), ({"gold": 1}, False), (1, False)],
)  # fmt: skip
def test_claims_match(value: Any, ok: bool) -> None:
    req = (("tier", frozenset({"gold", "silver"})),)
    c = {} if value is None else {"tier": value}
    assert jc.claims_match(c, req) is ok


def test_claims_match_scalars_as_text() -> None:
    req = (("level", frozenset({"2"})), ("admin", frozenset({"true"})))
    assert jc.claims_match({"level": 2, "admin": True}, req)
    assert not jc.claims_match({"level": 2, "admin": "yes"}, req)


@pytest.mark.parametrize(
    ("value", "header"),
    [
        ("acme", "acme"),
        (42, "42"),
        (True, "true"),
        ("a b-c_d.e", "a b-c_d.e"),
        ("x\r\nx-admin: 1", "x%0D%0Ax-admin: 1"),
        ("nul\x00", "nul%00"),
        ("100%", "100%25"),
        ("Zoë 张", "Zo%C3%AB %E5%BC%A0"),
        (["a"], ""),
        ({"a": 1}, ""),
        (None, ""),
        ("x" * 2000, ""),
        (math.inf, ""),
    ],
)
def test_header_value(value: Any, header: str) -> None:
    assert jc.header_value(value) == header
