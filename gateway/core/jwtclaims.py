"""(compiled) JWT claim checks (RFC 7519 §4.1, RFC 8725) as pure functions: claims and `now` in, a
reason out.

The signature is checked elsewhere (`gateway.auth.jwt`, PyJWT); this module decides whether the
verified claims are acceptable, whether they satisfy a route's requirement, and how a claim is
written into a header. Reasons are a small closed set (metric labels, log field), never text
taken from the token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

# Reason classes: why a token was refused (labels of sluice_auth_total, the access log `detail`).
MISSING = "missing"
MALFORMED = "malformed"
TOO_LARGE = "too_large"
AMBIGUOUS = "ambiguous"
BAD_HEADER = "bad_header"  # alg not allowed, crit, b64, typ, bad kid
UNKNOWN_ISSUER: Final = "unknown_issuer"
PROVIDER_NOT_ALLOWED = "provider_not_allowed"
UNKNOWN_KID = "unknown_kid"
NO_KEYS = "no_keys"  # the provider's key set is not loaded, or older than max_stale
BAD_SIGNATURE = "bad_signature"
BAD_CLAIM: Final = "bad_claim"  # a registered claim of the wrong type (exp as a string, ...)
EXPIRED: Final = "expired"
MISSING_EXP: Final = "missing_exp"
NOT_YET_VALID: Final = "not_yet_valid"
ISSUED_IN_FUTURE: Final = "issued_in_future"
TOO_LONG_LIVED: Final = "too_long_lived"
AUDIENCE: Final = "audience"
CLAIMS = "claims"  # valid token, the route's claim requirement not met (403)

# A NumericDate past this is no date (year ~285 million); refusing it keeps arithmetic exact.
MAX_NUMERIC_DATE: Final = 2.0**53
MAX_HEADER_VALUE: Final = 1024  # characters of a claim forwarded in a header


@dataclass(frozen=True, slots=True)
class ClaimRules:
    issuer: str
    audiences: frozenset[str]  # empty: `aud` not checked
    leeway: float
    require_exp: bool = True
    max_lifetime: float | None = None


def numeric_date(v: Any) -> float | None:
    """A NumericDate (RFC 7519 §2): a JSON number, not a bool or string; None if it is not one."""
    if type(v) is int:
        return float(v) if -MAX_NUMERIC_DATE <= v <= MAX_NUMERIC_DATE else None
    if type(v) is float and math.isfinite(v) and -MAX_NUMERIC_DATE <= v <= MAX_NUMERIC_DATE:
        return v
    return None


def _date(claims: Mapping[str, Any], name: str) -> tuple[bool, float | None]:
    """(well-formed, value): a claim that is absent is well-formed with value None."""
    if name not in claims:
        return True, None
    v = numeric_date(claims[name])
    return v is not None, v


def check_claims(claims: Mapping[str, Any], rules: ClaimRules, now: float) -> str:
    """ "" when the claims are acceptable at `now` (seconds since the epoch), else the reason."""
    ok_exp, exp = _date(claims, "exp")
    ok_nbf, nbf = _date(claims, "nbf")
    ok_iat, iat = _date(claims, "iat")
    if not (ok_exp and ok_nbf and ok_iat):
        return BAD_CLAIM
    iss = claims.get("iss")
    if type(iss) is not str or iss != rules.issuer:
        return UNKNOWN_ISSUER
    sub = claims.get("sub")
    if sub is not None and type(sub) is not str:
        return BAD_CLAIM
    leeway = rules.leeway
    if exp is None:
        if rules.require_exp or rules.max_lifetime is not None:
            return MISSING_EXP
    elif now > exp + leeway:
        return EXPIRED
    if nbf is not None and nbf > now + leeway:
        return NOT_YET_VALID
    if iat is not None and iat > now + leeway:
        return ISSUED_IN_FUTURE
    if rules.max_lifetime is not None:
        start = iat if iat is not None else nbf
        if start is None or exp is None or exp - start > rules.max_lifetime:
            return TOO_LONG_LIVED
    if rules.audiences:
        aud = claims.get("aud")
        if type(aud) is str:
            if aud not in rules.audiences:
                return AUDIENCE
        elif type(aud) is list and aud and all(type(a) is str for a in aud):
            if rules.audiences.isdisjoint(aud):
                return AUDIENCE
        else:
            return AUDIENCE  # missing, empty, or not strings
    return ""


def valid_until(claims: Mapping[str, Any], leeway: float) -> float:
    """When a token that passed `check_claims` stops being acceptable (inf without `exp`)."""
    exp = numeric_date(claims.get("exp"))
    return math.inf if exp is None else exp + leeway


def claim_text(v: Any) -> str | None:
    """A scalar claim as the text it is compared and forwarded as; None for other JSON types."""
    t = type(v)
    if t is str:
        return str(v)
    if t is bool:
        return "true" if v else "false"
    if t is int:
        return str(v) if abs(v) < 10**18 else None
    if t is float and math.isfinite(v):
        return repr(v)
    return None


def header_value(v: Any) -> str:
    """A claim as a header value; "" when it cannot be one (absent, object, list, too long).

    Printable ASCII without '%' goes as is; anything else is percent-encoded UTF-8 (RFC 3986),
    so a header never carries CR, LF, NUL or bytes a backend might read differently."""
    text = claim_text(v)
    if text is None or len(text) > MAX_HEADER_VALUE:
        return ""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text
    return quote(text, safe="".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%"))


@dataclass(frozen=True, slots=True)
class Requirement:
    """A route's auth requirement, compiled from the policy."""

    required: bool  # False: optional (no token passes anonymously)
    claims: tuple[tuple[str, frozenset[str]], ...] = ()
    providers: frozenset[str] = frozenset()  # empty: any provider


def claims_match(
    claims: Mapping[str, Any], required: tuple[tuple[str, frozenset[str]], ...]
) -> bool:
    """Every required claim is present with an accepted value (one element of a list claim)."""
    for name, accepted in required:
        v = claims.get(name)
        if type(v) is list:
            if not any(claim_text(x) in accepted for x in v):
                return False
        elif claim_text(v) not in accepted:
            return False
    return True
