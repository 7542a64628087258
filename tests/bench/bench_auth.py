"""The auth filter's own cost per request, in process: `python -m tests.bench.bench_auth`.

Prints µs per `on_request` (the best of several rounds, so other load on the machine inflates it
less) for: a route with auth off (claim headers stripped), a cached token (the budget: ≤ 3 µs),
and a fresh RS256 / ES256 / HS256 token (a signature check per request). The RequestContext is
built outside the timed part; the chain's own loop is not included.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.context import RequestContext
from gateway.core.request import RequestInfo, Wire
from gateway.filters.auth import build
from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy
from gateway.services import Services
from tests.auth import mint

ROUNDS = 7


def _policy(jwks_file: Path) -> Any:
    return compile_policy(
        Policy.model_validate(
            {
                "backends": [{"name": "b", "endpoints": [{"address": "127.0.0.1:1"}]}],
                "auth": {
                    "cache_size": 100,
                    "providers": [
                        {
                            "name": "corp",
                            "issuer": mint.ISSUER,
                            "audiences": ["sluice"],
                            "algorithms": ["RS256", "ES256"],
                            "jwks": {"file": str(jwks_file)},
                            "forward_claims": {"sub": "x-sluice-user", "tenant": "x-sluice-tenant"},
                        },
                        {
                            "name": "internal",
                            "issuer": mint.HS_ISSUER,
                            "audiences": ["sluice"],
                            "algorithms": ["HS256"],
                            "secret": {"env": "BENCH_HS"},
                        },
                    ],
                },
                "routes": [
                    {
                        "name": "off",
                        "match": {"path_prefix": "/off/"},
                        "backend": "b",
                        "auth": "off",
                    },
                    {"name": "on", "backend": "b", "auth": "required"},
                ],
            }
        )
    )


async def _per_call(f: Any, policy: Any, path: str, headers: list[dict[str, str]]) -> float:
    infos = [RequestInfo(Wire.HTTP, "GET", path, h) for h in headers]
    best = float("inf")
    for _ in range(ROUNDS):
        ctxs = [RequestContext(i, policy) for i in infos]
        t = time.perf_counter()
        for ctx in ctxs:
            await f.on_request(ctx)
        best = min(best, (time.perf_counter() - t) / len(ctxs))
        assert ctxs[-1].verdict.allowed, ctxs[-1].detail
    return best * 1e6


async def main() -> int:
    rs, es = mint.rsa_key("rs", "RS256"), mint.ec_key("es", "ES256")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "jwks.json").write_text(json.dumps(mint.jwks(rs, es)))
    os.environ["BENCH_HS"] = mint.HS_SECRET.decode()
    policy = _policy(tmp / "jwks.json")
    services = Services()
    f = build(policy, services)
    assert f is not None
    f.activate()
    await asyncio.sleep(0.2)  # the JWKS file is read in the background

    def fresh(key: Any, n: int, **over: Any) -> list[dict[str, str]]:
        return [
            {"authorization": f"Bearer {mint.jws(mint.claims(jti=str(i), **over), key)}"}
            for i in range(n)
        ]

    cached = [{"authorization": f"Bearer {mint.jws(mint.claims(), rs)}"}] * 20000
    rows = {
        "route off (headers stripped)": await _per_call(f, policy, "/off/x", [{}] * 20000),
        "cached token": await _per_call(f, policy, "/v1/x", cached),
    }
    # Fresh tokens: more distinct tokens than the cache holds, each used once per round.
    for name, key, over in (
        ("fresh RS256", rs, {}),
        ("fresh ES256", es, {}),
        ("fresh HS256", mint.HS_SECRET, {"iss": mint.HS_ISSUER}),
    ):
        rows[name] = await _per_call(f, policy, "/v1/x", fresh(key, 400, **over))
    await services.aclose()
    for name, us in rows.items():
        print(f"{name:32} {us:8.2f} µs/request")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
