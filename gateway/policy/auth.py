"""The `auth` section of the policy and the per-route `auth` setting (JWT authentication).

Validation only, no I/O: secrets and JWKS are read by `gateway.auth` when the filter is built and
in the background. Checks that span the document (unknown provider, duplicate issuer, `filters:`
without `auth`) are in `auth_reference_errors`, called from `model.reference_errors`.

```yaml
auth:
  default: off                    # routes without their own `auth`: required | optional | off
  providers:
    - name: corp
      issuer: "https://login.example.com/"
      audiences: ["sluice"]
      algorithms: [RS256, ES256]
      jwks: {url: "https://login.example.com/.well-known/jwks.json"}
      forward_claims: {sub: x-sluice-user, tenant: x-sluice-tenant}
routes:
  - name: openai
    auth: required                # or optional, off, or {required: true, claims: {tier: [gold]}}
```
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Sequence
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    PositiveFloat,
    PositiveInt,
    Tag,
    model_validator,
)

from gateway.policy.base import Loc, PolicyModel, fill_unset

ASYMMETRIC_ALGORITHMS = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA",
)  # fmt: skip
HMAC_ALGORITHMS = ("HS256", "HS384", "HS512")
Algorithm = Literal[
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA",
    "HS256", "HS384", "HS512",
]  # fmt: skip  # `none` is not in the list, and never will be

# Headers a claim may not be forwarded in: framing, routing, the token itself, what Sluice sets.
RESERVED_HEADERS = frozenset(
    {
        "host", "authorization", "proxy-authorization", "cookie", "content-length",
        "content-type", "content-encoding", "transfer-encoding", "connection", "keep-alive",
        "proxy-connection", "te", "trailer", "upgrade", "expect", "user-agent",
        "x-forwarded-for", "x-forwarded-proto", "x-request-id", "traceparent", "tracestate",
    }
)  # fmt: skip

HeaderName = Annotated[
    str,
    Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$",
        description="an HTTP header / gRPC metadata name (letters, digits, '-')",
    ),
]
ClaimName = Annotated[str, Field(min_length=1, max_length=128, description="a claim name")]
ClaimValue = str | int | bool


class JwksSource(PolicyModel):
    """Where a provider's public keys come from, and how they are cached."""

    file: str | None = Field(default=None, description="a JWKS JSON file (re-read like a URL)")
    url: str | None = Field(
        default=None, description="an https URL of the issuer's JWKS (http only to loopback)"
    )
    allow_http: bool = Field(
        default=False, description="allow a plain-http URL to a non-loopback host (not advised)"
    )
    cache_s: PositiveFloat = Field(
        default=600.0, description="refresh the key set in the background this often"
    )
    max_stale_s: PositiveFloat = Field(
        default=86400.0,
        description="while refreshes fail, keep using the last good set this long after it was "
        "fetched; then every token of the provider fails (closed); default max(86400, "
        "cache_s), at least cache_s",
    )
    unknown_kid_cooldown_s: PositiveFloat = Field(
        default=30.0,
        description="a token with an unknown `kid` triggers at most one refetch per this period",
    )
    timeout_s: PositiveFloat = Field(
        default=5.0, le=60.0, description="hard deadline of one fetch (connect, headers, body)"
    )
    max_bytes: PositiveInt = Field(
        default=262144, le=16 * 1024 * 1024, description="largest JWKS document accepted"
    )

    @model_validator(mode="after")
    def _check(self) -> JwksSource:
        if (self.file is None) == (self.url is None):
            raise ValueError("set exactly one of `file` or `url`")
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("`url` must be an http(s) URL with a host")
            if parts.scheme == "http" and not self.allow_http and not _loopback(parts.hostname):
                raise ValueError(
                    "a plain-http JWKS URL to a non-loopback host lets anyone on the path swap "
                    "the keys; use https, or set `allow_http: true`"
                )
        fill_unset(self, max_stale_s=max(86400.0, self.cache_s))
        if self.max_stale_s < self.cache_s:
            raise ValueError("`max_stale_s` must be at least `cache_s`")
        return self


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SecretSource(PolicyModel):
    """An HMAC secret, read when the policy is loaded (never written to logs or /admin)."""

    env: str | None = Field(default=None, description="environment variable holding it")
    file: str | None = Field(default=None, description="file holding it (trailing newline cut)")
    encoding: Literal["raw", "base64", "base64url"] = Field(
        default="raw", description="how the secret is written: raw bytes, base64 or base64url"
    )

    @model_validator(mode="after")
    def _one(self) -> SecretSource:
        if (self.env is None) == (self.file is None):
            raise ValueError("set exactly one of `env` or `file`")
        return self


class AuthProvider(PolicyModel):
    """One token issuer. A token is matched to the provider whose `issuer` equals its `iss`."""

    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$", description="metrics and log label"
    )
    issuer: str = Field(min_length=1, description="the `iss` claim, matched exactly")
    audiences: list[str] = Field(
        description="the token's `aud` must name one of these; `[]` turns the check off "
        "(a token minted for another service is then accepted too)"
    )
    algorithms: list[Algorithm] = Field(
        min_length=1,
        description="the only algorithms accepted (the token header never chooses); "
        "HS* only with `secret`, the others only with `jwks`",
    )
    jwks: JwksSource | None = Field(default=None, description="public keys (RS/PS/ES/EdDSA)")
    secret: SecretSource | None = Field(default=None, description="shared secret (HS*)")
    forward_claims: dict[ClaimName, HeaderName] = Field(
        default_factory=dict,
        description="claim -> header sent upstream; a client's own copy of these headers is "
        "always removed, also when the claim is absent",
    )
    leeway_s: float = Field(
        default=60.0, ge=0, le=300, description="clock skew allowed on exp, nbf and iat"
    )
    require_exp: bool = Field(default=True, description="refuse tokens without `exp`")
    max_lifetime_s: PositiveFloat | None = Field(
        default=None, description="refuse tokens whose exp - iat (or nbf) is longer than this"
    )
    typ: str | None = Field(
        default=None, description="required `typ` header, e.g. at+jwt (null = not checked)"
    )

    @model_validator(mode="after")
    def _check(self) -> AuthProvider:
        if (self.jwks is None) == (self.secret is None):
            raise ValueError("set exactly one of `jwks` or `secret`")
        if len(set(self.algorithms)) != len(self.algorithms):
            raise ValueError("`algorithms` lists an algorithm twice")
        hmac = [a for a in self.algorithms if a in HMAC_ALGORITHMS]
        if self.secret is not None and len(hmac) != len(self.algorithms):
            raise ValueError("a `secret` provider accepts only HS256/HS384/HS512")
        if self.jwks is not None and hmac:
            raise ValueError(
                "a `jwks` provider cannot accept HS* (its public keys would become HMAC secrets)"
            )
        for claim, header in self.forward_claims.items():
            low = header.lower()
            if low in RESERVED_HEADERS or low.startswith("grpc-"):
                raise ValueError(f"claim {claim!r} cannot be forwarded in {header!r} (reserved)")
        return self


def _yaml_words(v: Any) -> Any:
    # YAML 1.1 reads a bare `off` / `on` as a boolean.
    if v is False:
        return "off"
    if v is True:
        return "required"
    return v


class RouteAuth(PolicyModel):
    """A route's requirement, long form."""

    required: bool = Field(
        default=True,
        description="true: a valid token is needed (401); false: optional (no token passes "
        "anonymously, an invalid one is still refused)",
    )
    claims: dict[ClaimName, ClaimValue | list[ClaimValue]] = Field(
        default_factory=dict,
        description="claim -> accepted values; all listed claims must match (403 / "
        "PERMISSION_DENIED); a list-valued claim matches if one element does",
    )
    providers: list[str] = Field(
        default_factory=list, description="accept tokens of these providers only (empty = any)"
    )

    @model_validator(mode="after")
    def _check(self) -> RouteAuth:
        if self.claims and not self.required:
            raise ValueError("`claims` need `required: true`")
        return self


def _setting_kind(v: Any) -> str:
    return "long-form" if isinstance(v, dict | RouteAuth) else "short-form"


# A word or the long form; the discriminator keeps a bad value to the one error that applies.
RouteAuthSetting = Annotated[
    Annotated[
        Annotated[Literal["required", "optional", "off"], BeforeValidator(_yaml_words)],
        Tag("short-form"),
    ]
    | Annotated[RouteAuth, Tag("long-form")],
    Discriminator(_setting_kind),
]


class CredentialPlace(PolicyModel):
    """One place a client may put its token: a header, and the prefix before the token."""

    header: HeaderName = Field(description="HTTP header / gRPC metadata name")
    scheme: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9_-]*$",
        description="the value's prefix before one space ('' = the bare token)",
    )


# Where the OpenAI SDKs (`Authorization: Bearer`) and the Anthropic SDKs (`x-api-key`) put it.
DEFAULT_CREDENTIALS = (("authorization", "Bearer"), ("x-api-key", ""))


class Auth(PolicyModel):
    """JWT authentication: providers, and the requirement of routes that set none."""

    providers: list[AuthProvider] = Field(min_length=1, max_length=64, description="token issuers")
    default: RouteAuthSetting = Field(
        default="off", description="the requirement of routes without their own `auth`"
    )
    header: HeaderName | None = Field(
        default=None,
        description="shorthand for one place: the only header the token is read from (with "
        "`scheme`; null = `authorization` when `scheme` is set)",
    )
    scheme: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_-]*$",
        description="the prefix before one space of `header`'s value ('' = the bare token; "
        "null = Bearer)",
    )
    credentials: list[CredentialPlace] | None = Field(
        default=None,
        min_length=1,
        max_length=8,
        description="the places the token is read from, in order (a request with it in two "
        "places with different values is refused); null = `header`/`scheme` when set, else "
        "`Authorization: Bearer` and `x-api-key` (the OpenAI and Anthropic SDKs)",
    )
    max_token_bytes: PositiveInt = Field(
        default=8192,
        le=65536,
        description="a longer token header is refused (431 / RESOURCE_EXHAUSTED) undecoded",
    )
    cache_size: int = Field(
        default=10000,
        ge=0,
        le=1_000_000,
        description="verified tokens remembered (by SHA-256, until exp; oldest evicted; 0 = off)",
    )
    forward_token: bool = Field(
        default=False, description="pass the verified token header on to the backend"
    )

    @model_validator(mode="after")
    def _places(self) -> Auth:
        if self.credentials is not None and (self.header or self.scheme) is not None:
            raise ValueError("set `credentials`, or the shorthand `header`/`scheme`, not both")
        names = [c.header.lower() for c in self.credentials or ()]
        if len(set(names)) != len(names):
            raise ValueError("`credentials` names a header twice")
        return self

    def places(self) -> tuple[tuple[str, str], ...]:
        """(header, scheme) of each place the token is read from, in order."""
        if self.credentials is not None:
            return tuple((c.header.lower(), c.scheme) for c in self.credentials)
        if self.header is not None or self.scheme is not None:
            scheme = "Bearer" if self.scheme is None else self.scheme
            return (((self.header or "authorization").lower(), scheme),)
        return DEFAULT_CREDENTIALS


def auth_reference_errors(
    a: Auth | None, route_auth: Sequence[RouteAuthSetting | None], filters: Collection[str]
) -> list[tuple[Loc, str]]:
    """Auth problems that span the document, each at the field at fault: the `auth` section,
    each route's `auth` setting (in the order of `routes`) and the `filters` list."""
    errors: list[tuple[Loc, str]] = []
    if a is None:
        for i, setting in enumerate(route_auth):
            if setting is not None and setting != "off":
                errors.append((("routes", i, "auth"), "needs an `auth` section with providers"))
        return errors
    names: set[str] = set()
    issuers: dict[str, str] = {}
    for j, prov in enumerate(a.providers):
        if prov.name in names:
            errors.append((("auth", "providers", j, "name"), f"duplicate provider {prov.name!r}"))
        names.add(prov.name)
        if prov.issuer in issuers:
            errors.append(
                (
                    ("auth", "providers", j, "issuer"),
                    f"issuer {prov.issuer!r} is already provider {issuers[prov.issuer]!r}'s",
                )
            )
        issuers.setdefault(prov.issuer, prov.name)
    settings: list[tuple[Loc, RouteAuthSetting]] = [(("auth", "default"), a.default)]
    settings += [(("routes", i, "auth"), r) for i, r in enumerate(route_auth) if r]
    for loc, setting in settings:
        if isinstance(setting, RouteAuth):
            for k, name in enumerate(setting.providers):
                if name not in names:
                    known = ", ".join(sorted(names))
                    errors.append(((*loc, "providers", k), f"unknown provider {name!r} ({known})"))
    if "auth" not in filters:
        errors.append((("filters",), "`auth` is configured but 'auth' is not in `filters`"))
    return errors
