"""Each full-chain feature's cost in this process (by hand; not part of `make test`):

    .venv/bin/python -m tests.bench.bench_chain_features [--requests N] [--rounds R]

The chain of `sluice bench --full` (`gateway.bench.full`: JWT with a cached token, two rate-limit
rules of which one reserves and reconciles tokens, a monthly token budget, tail-sampled tracing,
breaker + outlier + retries) and the same chain without one feature, built as the server builds
them, run on the bench's chat POST one request after the other: the request phase, the body
phase (`forward.body_phase`: parse, `from_doc`, `on_body`), the answer's response phase (a JSON
answer with `usage`, when the chain listens), the finish (`on_response`, `record_request`). CPU
time of this process per request; the chains take turns within each round and each figure is
the best round, so a drift of the machine moves all of them alike. The feature's cost is the
full chain's minus the chain's without it.

What this leaves out, which `sluice bench --full`'s pairs include: the sockets, the forwarding
path's own share of a feature (the traceparent of each try, a retry's budget), and the colder
caches of a whole server. It is the figure to read when the pairs' spread is wider than the
budgets, as on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.bench.full import BUDGET_US, FEATURES, prepare, with_full_chain  # noqa: E402
from gateway.bench.gateways import Variant, policy_doc  # noqa: E402
from gateway.bench.loads import CHAT_BODY, CHAT_PATH  # noqa: E402
from gateway.bench.procs import CHAT_JSON  # noqa: E402
from gateway.context import RequestContext  # noqa: E402
from gateway.core.request import RequestInfo, Wire  # noqa: E402
from gateway.filters.registry import build_chain  # noqa: E402
from gateway.policy.compiled import compile_policy  # noqa: E402
from gateway.policy.model import Policy  # noqa: E402
from gateway.services import Services  # noqa: E402
from tests.bench.bench_ratelimit import _response_phase  # noqa: E402


class Bench:
    """One chain, ready to run requests through its phases."""

    def __init__(self, doc: dict[str, Any], token: str) -> None:
        from gateway.snapshot import Snapshot

        self.p = compile_policy(Policy.model_validate(doc))
        self.services = Services()
        self.chain = build_chain(self.p, self.services)
        self.chain.activate()
        self.snap = Snapshot(self.p, self.chain)
        headers = {
            "content-type": "application/json",
            "content-length": str(len(CHAT_BODY)),
            "authorization": f"Bearer {token}",
            "host": "bench",
        }
        self.info = RequestInfo(Wire.HTTP, "POST", CHAT_PATH, headers, "10.0.0.1", "bench",
                                len(CHAT_BODY))  # fmt: skip

    async def run(self, n: int, body: bytes, answer: bytes) -> float:
        """CPU µs per request of `n` requests through every phase."""
        from gateway.forward.body_phase import body_phase
        from gateway.telemetry.requests import record_request

        chain, info, p = self.chain, self.info, self.p
        response_phase = _response_phase()
        t = time.process_time()
        for _ in range(n):
            ctx = RequestContext(info, p)
            r = chain.run_request(ctx)
            if hasattr(r, "__await__"):
                await r
            body_phase(ctx, self.snap.chain, body, info.content_length)
            if chain.listens(ctx):
                response_phase(ctx, chain, answer)
            ctx.http_status = 200  # as the forwarding path leaves an OK answer
            ctx.first_byte_at = ctx.ended = time.monotonic()
            chain.on_response_plain(ctx)
            record_request(ctx)
        return (time.process_time() - t) / n * 1e6


async def main_async(n: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = prepare(Path(tmp))
        ports = {"http": 1, "grpc": 2, "admin": 3}
        base = policy_doc(ports, 1, None, False, Variant("native", full=True))
        chains = {"full": Bench(with_full_chain(base, files), files.token)}
        for f in FEATURES:
            chains[f] = Bench(with_full_chain(base, files, without=f), files.token)
        body, answer = CHAT_BODY.encode(), CHAT_JSON.encode()
        for b in chains.values():  # warm: caches filled, the token verified once
            await b.run(2000, body, answer)
        gc.collect()
        gc.freeze()
        best = {k: float("inf") for k in chains}
        for _ in range(rounds):
            for k, b in chains.items():
                best[k] = min(best[k], await b.run(n, body, answer))
                await asyncio.sleep(0)  # the background tasks (syncs) run between chains
        print("  ".join(f"{k} {v:.2f}" for k, v in best.items()))
        full = best["full"]
        print(f"full chain, in process: {full:.2f} µs/request (best of {rounds} rounds of {n})")
        for f in FEATURES:
            cost = full - best[f]
            verdict = "within" if cost <= BUDGET_US[f] else "OVER"
            print(f"  {f:<11} {cost:+6.2f} µs/request  (budget ≤ {BUDGET_US[f]:g}: {verdict})")
        for b in chains.values():
            await b.services.aclose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    asyncio.run(main_async(args.requests, args.rounds))


if __name__ == "__main__":
    main()
