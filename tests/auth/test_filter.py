"""The auth filter in process: hook kind, cache behaviour, headers it sets."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.context import RequestContext, Status
from gateway.core.request import RequestInfo, Wire
from gateway.filters.auth import AuthFilter, PlainAuthFilter, build
from gateway.filters.chain import Chain
from gateway.filters.request_id import RequestIdFilter
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.model import Policy
from gateway.services import Services
from tests.auth import mint

RS = mint.rsa_key("rs", "RS256")


def compiled(providers: list[dict[str, Any]], **auth: Any) -> CompiledPolicy:
    return compile_policy(
        Policy.model_validate(
            {
                "backends": [{"name": "b", "endpoints": [{"address": "127.0.0.1:1"}]}],
                "auth": {"providers": providers, **auth},
                "routes": [
                    {"name": "opt", "match": {"path_prefix": "/opt/"}, "backend": "b",
                     "auth": "optional"},
                    {"name": "on", "backend": "b", "auth": "required"},
                ],
            }
        )
    )  # fmt: skip


def hs_provider(**over: Any) -> dict[str, Any]:
    return {
        "name": "internal",
        "issuer": mint.HS_ISSUER,
        "audiences": ["sluice"],
        "algorithms": ["HS256"],
        "secret": {"env": "T_HS_SECRET"},
        "forward_claims": {"sub": "x-user"},
        **over,
    }


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T_HS_SECRET", mint.HS_SECRET.decode())


@pytest.fixture
async def services() -> AsyncIterator[Services]:
    s = Services()
    try:
        yield s
    finally:
        await s.aclose()


async def call(f: Any, policy: CompiledPolicy, path: str, **headers: str) -> RequestContext:
    ctx = RequestContext(RequestInfo(Wire.HTTP, "GET", path, headers), policy)
    r = f.on_request(ctx)
    if asyncio.iscoroutine(r):
        r = await r
    assert (r is Status.STOP) == (not ctx.verdict.allowed)
    return ctx


def hs(**over: Any) -> str:
    return "Bearer " + mint.jws(mint.claims(iss=mint.HS_ISSUER, **over), mint.HS_SECRET)


async def test_hmac_only_policy_keeps_the_chain_plain(services: Services, tmp_path: Path) -> None:
    f = build(compiled([hs_provider()]), services)
    assert type(f) is PlainAuthFilter
    assert Chain([RequestIdFilter(), f]).sync_request
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(mint.jwks(RS)))
    corp = {**hs_provider(), "name": "corp", "issuer": mint.ISSUER, "algorithms": ["RS256"]}
    corp.pop("secret")
    corp["jwks"] = {"file": str(jwks)}
    g = build(compiled([hs_provider(), corp]), services)
    assert type(g) is AuthFilter and not Chain([RequestIdFilter(), g]).sync_request


async def test_cached_token_expires_with_exp(services: Services) -> None:
    p = compiled([hs_provider(leeway_s=0)])
    f = build(p, services)
    exp = int(time.time()) + 1
    token = hs(exp=exp)
    assert (await call(f, p, "/v1/x", authorization=token)).verdict.allowed
    assert (await call(f, p, "/v1/x", authorization=token)).verdict.allowed  # a hit
    while time.time() <= exp + 0.05:
        await asyncio.sleep(0.05)
    ctx = await call(f, p, "/v1/x", authorization=token)
    assert ctx.verdict.http_status == 401 and ctx.detail == "auth expired (internal)"


async def test_cache_is_bounded_oldest_first(services: Services) -> None:
    p = compiled([hs_provider()], cache_size=2)
    f = build(p, services)
    tokens = [hs(jti=str(i)) for i in range(3)]
    for t in tokens:
        assert (await call(f, p, "/v1/x", authorization=t)).verdict.allowed
    state = services.state()["auth.tokens"]
    assert state == {"entries": 2, "size": 2, "evictions": 1}


async def test_headers_set_and_stripped(services: Services) -> None:
    p = compiled([hs_provider()])
    f = build(p, services)
    ctx = await call(f, p, "/v1/x", authorization=hs(sub="alice"))
    # every place a token may be is dropped (the default: Authorization and x-api-key)
    assert ctx.upstream_headers == {"x-user": "alice", "authorization": "", "x-api-key": ""}
    assert ctx.principal is not None and ctx.principal.subject == "alice"
    assert ctx.principal.provider == "internal" and ctx.principal.claims["sub"] == "alice"
    anon = await call(f, p, "/opt/x")
    assert anon.verdict.allowed and anon.principal is None
    assert anon.upstream_headers == {"x-user": ""}  # a client's x-user never passes
    odd = await call(f, p, "/v1/x", authorization=hs(sub="a\r\nb"))
    assert odd.upstream_headers["x-user"] == "a%0D%0Ab"
    keep = compiled([hs_provider()], forward_token=True)
    g = build(keep, services)
    assert (
        "authorization" not in (await call(g, keep, "/v1/x", authorization=hs())).upstream_headers
    )


async def test_the_default_places_cover_both_sdks(services: Services) -> None:
    p = compiled([hs_provider()])
    f = build(p, services)
    bare = hs(sub="bob").removeprefix("Bearer ")
    ctx = await call(f, p, "/v1/x", **{"x-api-key": bare})  # the Anthropic SDK's header
    assert ctx.verdict.allowed and ctx.principal is not None
    assert ctx.principal.subject == "bob"
    # the same token in both places is one credential; two different ones are refused
    same = await call(f, p, "/v1/x", authorization="bearer " + bare, **{"x-api-key": bare})
    assert same.verdict.allowed
    other = hs(sub="eve").removeprefix("Bearer ")
    two = await call(f, p, "/v1/x", authorization="Bearer " + bare, **{"x-api-key": other})
    assert two.verdict.http_status == 400 and two.detail == "auth ambiguous"
    # a route without auth passes both on untouched, whatever they hold
    off = compile_policy(
        Policy.model_validate(
            {
                "backends": [{"name": "b", "endpoints": [{"address": "127.0.0.1:1"}]}],
                "auth": {"providers": [hs_provider()]},
                "routes": [{"name": "free", "backend": "b"}],  # auth.default: off
            }
        )
    )
    g = build(off, services)
    free = await call(g, off, "/v1/x", authorization="Bearer sk-1", **{"x-api-key": "sk-2"})
    assert free.verdict.allowed and "x-api-key" not in free.upstream_headers
    # a bare token is read from x-api-key only: `Authorization` still needs its scheme
    assert (await call(f, p, "/v1/x", authorization=bare)).verdict.http_status == 401
    assert (await call(f, p, "/v1/x", authorization=bare)).verdict.http_status == 401


async def test_header_and_scheme_are_one_place(services: Services) -> None:
    """The shorthand of earlier policies reads exactly that one header, as before."""
    p = compiled([hs_provider()], header="x-token", scheme="")
    f = build(p, services)
    token = hs().removeprefix("Bearer ")
    assert (await call(f, p, "/v1/x", **{"x-token": token})).verdict.allowed
    assert (await call(f, p, "/v1/x", **{"x-api-key": token})).verdict.http_status == 401
    q = compiled([hs_provider()], header="authorization")
    g = build(q, services)
    assert (await call(g, q, "/v1/x", authorization=hs())).verdict.allowed
    assert (await call(g, q, "/v1/x", **{"x-api-key": token})).verdict.http_status == 401
    r = compiled(
        [hs_provider()], credentials=[{"header": "x-key"}, {"header": "x-auth", "scheme": "Token"}]
    )
    h = build(r, services)
    assert (await call(h, r, "/v1/x", **{"x-auth": "Token " + token})).verdict.allowed
    assert (await call(h, r, "/v1/x", **{"x-key": token})).verdict.allowed
    assert (await call(h, r, "/v1/x", authorization=hs())).verdict.http_status == 401


def test_credentials_and_the_shorthand_do_not_mix() -> None:
    with pytest.raises(ValueError, match="not both"):
        compiled([hs_provider()], header="x-token", credentials=[{"header": "x-api-key"}])
    with pytest.raises(ValueError, match="twice"):
        compiled([hs_provider()], credentials=[{"header": "X-Key"}, {"header": "x-key"}])


async def test_a_reload_with_the_same_auth_keeps_the_cache(services: Services) -> None:
    p = compiled([hs_provider()])
    f = build(p, services)
    await call(f, p, "/v1/x", authorization=hs(jti="keep"))
    same = build(compiled([hs_provider()]), services)
    assert same is not None and same._cache is f._cache
    changed = build(compiled([hs_provider(leeway_s=5)]), services)
    assert changed is not None and changed._cache is not f._cache


async def test_client_certificate_is_the_principal_without_a_jwt(services: Services) -> None:
    p = compiled([hs_provider()])
    f = build(p, services)

    async def with_cert(path: str, **headers: str) -> RequestContext:
        info = RequestInfo(Wire.HTTP, "GET", path, headers, client_cert="spiffe://t/a")
        ctx = RequestContext(info, p)
        r = f.on_request(ctx)
        assert (r is Status.STOP) == (not ctx.verdict.allowed)
        return ctx

    anon = await with_cert("/opt/x")
    assert anon.verdict.allowed and anon.principal is not None
    assert (anon.principal.provider, anon.principal.subject) == ("client_cert", "spiffe://t/a")
    basic = await with_cert("/opt/x", authorization="Basic dTpw")  # not a JWT either
    assert basic.principal is not None and basic.principal.provider == "client_cert"
    token = await with_cert("/opt/x", authorization=hs(sub="alice"))  # a JWT wins
    assert token.principal is not None and token.principal.provider == "internal"
    # The certificate identifies; it does not stand in for the token a route requires.
    required = await with_cert("/v1/x")
    assert required.verdict.http_status == 401
    assert (await call(f, p, "/opt/x")).principal is None  # no certificate, no token
