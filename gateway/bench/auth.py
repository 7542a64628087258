"""The JWT rows of `sluice bench --auth`: a second Sluice with an `auth` section, the same backend.

- HTTP auth on, route off (token sent): the same Authorization header as the next row, on a
  route with auth off (the filter only strips claim headers): the baseline of the cached row.
- HTTP auth on, cached token: one RS256 token on every request (a verified-token cache hit).
- HTTP auth on, fresh RS256 / ES256 token: wrk cycles through `FRESH_TOKENS` distinct tokens
  with `cache_size` smaller than that, so every request verifies a signature.

The row "HTTP Sluice (engine)" of the same run, without an `auth` section, is "auth off"; the
auth gateway runs the first `--engine` with the default chain (plus `--policy-extra`). Keys
and tokens are made here (PyJWT), the JWKS is a file: no network beyond the measured path.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.bench.loads import parse_wrk, wrk_cmd
from gateway.bench.report import Row

if TYPE_CHECKING:
    from gateway.bench.gateways import RunRow, Setup, Variant

FRESH_TOKENS = 2000
CACHE_SIZE = 500  # < FRESH_TOKENS: cycling through them never hits
ISSUER = "https://bench.sluice/"

_LUA = """\
local tokens = {}
for line in io.lines("%s") do tokens[#tokens + 1] = line end
local i = 0
request = function()
  i = i + 1
  if i > #tokens then i = 1 end
  return wrk.format("GET", nil, {["Authorization"] = "Bearer " .. tokens[i]})
end
"""


@dataclass
class AuthFiles:
    jwks: Path
    cached_token: str
    scripts: dict[str, Path]  # alg -> wrk Lua script cycling through fresh tokens


def prepare(tmp: Path) -> AuthFiles:
    """Keys, a JWKS file, one token to cache and a wrk script per algorithm."""
    import jwt
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from jwt.algorithms import ECAlgorithm, RSAAlgorithm

    keys: dict[str, Any] = {
        "RS256": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "ES256": ec.generate_private_key(ec.SECP256R1()),
    }
    doc: dict[str, list[Any]] = {"keys": []}
    for alg, k in keys.items():
        to_jwk = RSAAlgorithm.to_jwk if alg == "RS256" else ECAlgorithm.to_jwk
        jwk = json.loads(to_jwk(k.public_key()))
        doc["keys"].append({**jwk, "kid": f"bench-{alg}", "alg": alg, "use": "sig"})
    path = tmp / "bench-jwks.json"
    path.write_text(json.dumps(doc))
    now = int(time.time())

    def mint(alg: str, n: int) -> str:
        claims: dict[str, Any] = {"iss": ISSUER, "aud": "sluice", "sub": f"u{n}", "tenant": "t"}
        claims |= {"iat": now, "exp": now + 3600}
        return jwt.encode(claims, keys[alg], algorithm=alg, headers={"kid": f"bench-{alg}"})

    scripts: dict[str, Path] = {}
    for alg in keys:
        tokens = tmp / f"tokens-{alg}.txt"
        tokens.write_text("\n".join(mint(alg, n) for n in range(FRESH_TOKENS)) + "\n")
        script = tmp / f"fresh-{alg}.lua"
        script.write_text(_LUA % tokens)
        scripts[alg] = script
    return AuthFiles(path, mint("RS256", -1), scripts)


def with_auth(doc: dict[str, Any], files: AuthFiles) -> dict[str, Any]:
    """The bench policy plus an `auth` section; HTTP routes need a token except under /off/."""
    doc = json.loads(json.dumps(doc))
    doc["auth"] = {
        "cache_size": CACHE_SIZE,
        "providers": [
            {
                "name": "bench",
                "issuer": ISSUER,
                "audiences": ["sluice"],
                "algorithms": ["RS256", "ES256"],
                "jwks": {"file": str(files.jwks)},
                "forward_claims": {"sub": "x-sluice-user", "tenant": "x-sluice-tenant"},
            }
        ],
    }
    routes = []
    for r in doc["routes"]:
        if r["match"].get("protocol") == "http":
            off = {**r, "name": "http-off", "auth": "off", "strip_prefix": "/off"}
            routes.append({**off, "match": {**r["match"], "path_prefix": "/off/"}})
            r = {**r, "auth": "required"}
        routes.append(r)
    doc["routes"] = routes
    return doc


def wrk_args(files: AuthFiles, variant: str) -> list[str]:
    """Extra wrk arguments of a row: a header for the cached token, a script for fresh ones."""
    if variant == "cached":
        return ["-H", f"Authorization: Bearer {files.cached_token}"]
    return ["-s", str(files.scripts[variant])]


def auth_rows(s: Setup, http_be: int, variant: Variant, run: RunRow) -> list[Row]:
    """The JWT rows, through a gateway of `variant` with an `auth` section, started for them."""
    from gateway.bench.gateways import start_gateway

    names = {
        "off": "HTTP auth on, route off (token sent)",
        "cached": "HTTP auth on, cached token",
        "RS256": "HTTP auth on, fresh RS256 token",
        "ES256": "HTTP auth on, fresh ES256 token",
    }
    rows = [Row(f"{n} {variant.label}") for n in names.values()]
    try:
        files = prepare(s.procs.tmp)
        gw, ports = start_gateway(
            s, http_be, None, variant, "gateway-auth", edit=lambda d: with_auth(d, files)
        )
    except Exception as e:
        for r in rows:
            r.error = f"auth gateway did not start: {e}"
        return rows
    base = f"http://127.0.0.1:{ports['http']}"
    try:
        for row, kind in zip(rows, names, strict=True):
            url = f"{base}/off/v1/models" if kind == "off" else f"{base}/v1/models"
            extra = wrk_args(files, "cached" if kind == "off" else kind)
            run(row, wrk_cmd(s.load_cpus, s.args.connections, url, extra), parse_wrk, gw.pid)
            if row.error is None and row.requests and row.failed > row.requests // 100:
                row.error = f"{row.failed} of {row.requests} requests failed (auth refused?)"
    finally:
        s.procs.stop(gw)
    off, cached = rows[0], rows[1]
    if off.cpu_us_per_req and cached.cpu_us_per_req:
        delta = cached.cpu_us_per_req - off.cpu_us_per_req
        s.notes.append(
            f"auth: checking a cached token costs {delta:+.1f} µs/req over the same request on a "
            "route with auth off (budget ≤ 3)"
        )
    return rows
