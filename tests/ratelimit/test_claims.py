"""Keys and priorities from verified JWT claims: the auth filter runs first in the chain, the
limiter reads `ctx.principal` (HS256 tokens minted by the tests' own signer)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.context import RequestContext
from gateway.core.request import RequestInfo, Wire
from gateway.filters.chain import Chain
from gateway.filters.registry import build_chain
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.model import Policy
from gateway.services import Services
from tests.auth import mint

DOC: dict[str, Any] = {
    "backends": [{"name": "b", "endpoints": [{"address": "127.0.0.1:1"}]}],
    "routes": [{"name": "on", "backend": "b", "auth": "required"}],
    "auth": {
        "providers": [
            {"name": "internal", "issuer": mint.HS_ISSUER, "audiences": ["sluice"],
             "algorithms": ["HS256"], "secret": {"env": "T_HS_SECRET"}},
        ]
    },
    "rate_limits": {
        "priority": {"from": "claim:tier", "classes": {"gold": 0, "free": 2}, "default": 2},
        "rules": [{"name": "per-tenant", "key": ["claim:tenant"], "qps": 5}],
    },
}  # fmt: skip


@pytest.fixture
async def rig(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Chain, CompiledPolicy]]:
    monkeypatch.setenv("T_HS_SECRET", mint.HS_SECRET.decode())
    services = Services()
    p = compile_policy(Policy.model_validate(DOC))
    chain = build_chain(p, services)
    assert [f.name for f in chain.filters][-3:] == ["auth", "ratelimit", "route"]
    try:
        yield chain, p
    finally:
        await services.aclose()


def token(**claims: Any) -> str:
    return "Bearer " + mint.jws(mint.claims(iss=mint.HS_ISSUER, **claims), mint.HS_SECRET)


async def send(chain: Chain, p: CompiledPolicy, auth: str) -> RequestContext:
    info = RequestInfo(Wire.HTTP, "POST", "/v1/x", {"authorization": auth}, peer="10.0.0.1")
    ctx = RequestContext(info, p)
    await chain.on_request(ctx)
    await chain.on_response(ctx)
    return ctx


async def test_claims_key_the_buckets_and_name_the_class(
    rig: tuple[Chain, CompiledPolicy],
) -> None:
    chain, p = rig
    a = token(tenant="acme", tier="gold")
    b = token(tenant="bolt", tier="free")
    first = [await send(chain, p, a) for _ in range(8)]
    assert [c.verdict.http_status for c in first].count(200) == 5
    assert first[0].priority == 0
    other = await send(chain, p, b)  # another tenant: its own bucket
    assert other.verdict.http_status == 200 and other.priority == 2
    forged = await send(chain, p, "Bearer not-a-token")
    assert forged.verdict.http_status == 401  # auth refuses before the limiter counts anything
    assert all(c.principal is not None for c in first)
    assert {c.verdict.http_status for c in first[5:]} == {429}
