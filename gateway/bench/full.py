"""The full chain of `sluice bench --full`: every per-request feature on, nothing refused.

Over the bench policy of the variant: JWT (HS256, one token sent on every request, so a
verified-token cache hit), two rate-limit rules on the memory store (per tenant from the token's
claim with an LLM-token budget, per source address by rate), a monthly token budget per tenant
(memory), tail-sampled tracing as shipped
(OK requests are not kept, nothing is exported), and on the HTTP backend a circuit breaker,
outlier ejection and retries. The limits are far above what the machine can send, so every
request is admitted and the token rule reserves and reconciles on every POST (the bench backend
answers with `usage`).

Each feature's cost in place is the full row minus the row without it (`FEATURES`: the rows
`full chain − auth` etc. of the first engine), printed against its budget (`BUDGET_US`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ISSUER = "https://bench.sluice/"
# The features the full chain adds to the default one, and what each may cost per request
# (µs of gateway CPU; README "Benchmarks"): auth with a cached token, two rate-limit rules (one
# with tokens, reserved and reconciled), one token budget (reserved and settled), tail-sampled
# tracing, breaker + outlier + retries.
FEATURES = ("auth", "rate_limits", "budgets", "tracing", "resilience")
BUDGET_US = {"auth": 3.0, "rate_limits": 5.0, "budgets": 3.0, "tracing": 5.0, "resilience": 3.0}
SECRET = "sluice-bench-hs256-secret-of-32-bytes-or-more"  # a bench fixture, not a credential


@dataclass
class FullChain:
    secret_file: Path
    token: str

    @property
    def wrk_headers(self) -> list[str]:
        return ["-H", f"Authorization: Bearer {self.token}"]


def prepare(tmp: Path) -> FullChain:
    """The HMAC secret file and one token signed with it (PyJWT)."""
    import jwt

    path = tmp / "bench-hs256.secret"
    path.write_text(SECRET)
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": "sluice", "sub": "bench", "tenant": "t1", "tier": "gold"}
    token = jwt.encode({**claims, "iat": now, "exp": now + 86400}, SECRET, algorithm="HS256")
    return FullChain(path, token)


def with_full_chain(
    doc: dict[str, Any], files: FullChain, without: str | None = None
) -> dict[str, Any]:
    """The bench policy with the full chain's sections (all but the feature `without`)."""
    doc = json.loads(json.dumps(doc))
    doc.pop("filters", None)  # the default order, with auth, rate limits and trace in it
    doc["auth"] = {
        "providers": [
            {
                "name": "bench",
                "issuer": ISSUER,
                "audiences": ["sluice"],
                "algorithms": ["HS256"],
                "secret": {"file": str(files.secret_file)},
                "forward_claims": {"sub": "x-sluice-user", "tenant": "x-sluice-tenant"},
            }
        ],
    }
    doc["rate_limits"] = {
        "priority": {"from": "claim:tier", "classes": {"gold": 0, "free": 1}, "default": 1},
        "rules": [
            {
                "name": "per-tenant",
                "key": ["claim:tenant"],
                "qps": 1_000_000,
                "tokens_per_second": 100_000_000,
            },
            {"name": "per-ip", "key": ["source_ip"], "qps": 1_000_000},
        ],
    }
    doc["budgets"] = {
        "rules": [
            {
                "name": "per-tenant-month",
                "key": ["claim:tenant"],
                "tokens": 10**15,
                "period": {"calendar": "month"},
            }
        ],
    }
    doc["tracing"] = {"enabled": True, "sample_ratio": 1e-5, "slow_ms": 2000}
    resilience = without != "resilience"
    for b in doc["backends"]:
        if b.get("protocol") == "http" and resilience:
            b["breaker"] = {"consecutive_failures": 5, "error_ratio": 0.5, "min_requests": 20}
            b["outlier"] = {"timeout_ratio": 0.15, "window_s": 120}
    for r in doc["routes"]:
        if r["match"].get("protocol") == "http":
            if without != "auth":
                r["auth"] = "required"
            if resilience:
                r["retries"] = {"attempts": 2, "budget_ratio": 0.2}
    if without in ("auth", "rate_limits", "budgets", "tracing"):
        doc.pop(without)
    return doc
