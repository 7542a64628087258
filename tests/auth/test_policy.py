"""The `auth` policy section: the issue's YAML validates as written; mistakes point at lines."""

from __future__ import annotations

import pytest

from gateway.errors import PolicyError
from gateway.policy.auth import RouteAuth
from gateway.policy.loader import load_policy_text
from gateway.policy.model import DEFAULT_FILTERS

BACKENDS = """\
version: 1
backends:
  - name: vllm
    protocol: http
    endpoints: [{address: "10.0.0.11:8000"}]
  - name: triton
    protocol: grpc
    endpoints: [{address: "10.0.0.21:8001"}]
"""

ISSUE_YAML = (
    BACKENDS
    + """\
auth:
  providers:
    - name: corp
      issuer: "https://login.example.com/"
      audiences: ["sluice"]
      algorithms: [RS256, ES256]
      jwks: {file: /etc/sluice/jwks.json}     # or {url: "https://login.example.com/.well-known/jwks.json"}
      forward_claims: {sub: x-sluice-user, tenant: x-sluice-tenant}
    - name: internal
      issuer: internal
      audiences: ["sluice"]
      algorithms: [HS256]
      secret: {env: SLUICE_INTERNAL_SECRET}   # or {file: /run/secrets/sluice}
routes:
  - name: openai
    match: {protocol: http, path_prefix: /v1/}
    backend: vllm
    auth: required                            # required | optional | off
  - name: triton
    match: {protocol: grpc}
    backend: triton
    auth: {required: true, claims: {tier: [gold, silver]}}"""
    + "   # claim requirement → 403 / PERMISSION_DENIED\n"
)


def test_the_issue_yaml_validates_with_documented_defaults() -> None:
    p = load_policy_text(ISSUE_YAML, "p.yaml")
    assert p.auth is not None and p.auth.default == "off"
    corp, internal = p.auth.providers
    assert corp.leeway_s == 60 and corp.require_exp and corp.max_lifetime_s is None
    assert corp.jwks is not None and corp.jwks.cache_s == 600
    assert corp.jwks.unknown_kid_cooldown_s == 30 and corp.jwks.max_stale_s == 86400
    assert corp.jwks.max_bytes == 262144 and corp.jwks.timeout_s == 5
    assert p.auth.cache_size == 10000 and p.auth.max_token_bytes == 8192
    assert internal.secret is not None and internal.secret.env == "SLUICE_INTERNAL_SECRET"
    assert p.routes[0].auth == "required"
    assert p.routes[1].auth == RouteAuth(required=True, claims={"tier": ["gold", "silver"]})
    assert DEFAULT_FILTERS.index("auth") == DEFAULT_FILTERS.index("access_log") + 1
    assert "auth" in p.filters


def test_yaml_off_and_on_words() -> None:
    text = ISSUE_YAML.replace("auth: required ", "auth: off ").replace(
        "  providers:\n", "  default: on\n  providers:\n", 1
    )
    p = load_policy_text(text, "p.yaml")
    assert p.routes[0].auth == "off" and p.auth is not None and p.auth.default == "required"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("auth: required ", "auth: maybe "), "p.yaml:26:11: routes[0].auth: Input should be"),
        (
            ("{required: true, claims", "{required: false, claims"),
            "p.yaml:30:11: routes[1].auth: `claims` need `required: true`",
        ),
        (
            ("{required: true, claims: {tier: [gold, silver]}}", "{providers: [nobody]}"),
            "p.yaml:30:24: routes[1].auth.providers[0]: unknown provider 'nobody'",
        ),
        (
            ("algorithms: [HS256]", "algorithms: [HS256, RS256]"),
            "p.yaml:17:7: auth.providers[1]: a `secret` provider accepts only HS256",
        ),
        (
            ("algorithms: [RS256, ES256]", "algorithms: [RS256, HS256]"),
            "auth.providers[0]: a `jwks` provider cannot accept HS*",
        ),
        (("algorithms: [RS256, ES256]", "algorithms: [none]"), "algorithms[0]: Input should be"),
        (
            ("{file: /etc/sluice/jwks.json}", '{url: "http://login.example.com/jwks"}'),
            "auth.providers[0].jwks: a plain-http JWKS URL",
        ),
        (("sub: x-sluice-user", "sub: authorization"), "cannot be forwarded in 'authorization'"),
        (("sub: x-sluice-user", "sub: grpc-status"), "(reserved)"),
        (("issuer: internal", 'issuer: "https://login.example.com/"'), "is already provider"),
        (("name: internal", "name: corp"), "p.yaml:17:13: auth.providers[1].name: duplicate"),
        (('audiences: ["sluice"]\n      algorithms: [HS256]', "algorithms: [HS256]"), "audiences"),
    ],
)
def test_mistakes_point_at_their_line(change: tuple[str, str], expected: str) -> None:
    text = ISSUE_YAML.replace(*change, 1)
    assert text != ISSUE_YAML
    with pytest.raises(PolicyError) as e:
        load_policy_text(text, "p.yaml")
    assert any(expected in line for line in e.value.errors), e.value.errors


def test_auth_needs_its_filter_and_routes_need_the_section() -> None:
    with pytest.raises(PolicyError) as e:
        load_policy_text(ISSUE_YAML + "filters: [request_id, route]\n", "p.yaml")
    assert any("'auth' is not in `filters`" in x for x in e.value.errors), e.value.errors
    no_section = BACKENDS + "routes:\n  - name: r\n    backend: vllm\n    auth: required\n"
    with pytest.raises(PolicyError) as e:
        load_policy_text(no_section, "p.yaml")
    assert e.value.errors == [
        "p.yaml:12:11: routes[0].auth: needs an `auth` section with providers"
    ]
    off = no_section.replace("auth: required", "auth: off")
    assert load_policy_text(off, "p.yaml").routes[0].auth == "off"
