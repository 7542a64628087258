"""The time series behind the status page's charts: one point per sample (every `sample_s`, the
last 15 minutes), computed from what the gateway already counts, never on the request path.

    series  {step_s, t: [Unix times],
             backends: {name: {rps: [..], p99_ms: [..], ttft_p99_ms: [..]}},
             queues: {pool: [requests waiting]},
             tenants: {tenant: [share of the tokens served in the interval, 0..1]}}

Per backend: requests/s from `sluice_requests_total`, p99 latency from
`sluice_request_duration_seconds` of the routes that go to that backend alone, p99 time to
first token from `sluice_time_to_first_token_seconds` (a p99 is the upper bound of the bucket
it falls in, over the interval; null when nothing was measured). Queue lengths and tenants'
served tokens come from the `admission` section of the state document. Bounded: `KEEP_S` of
points per line; lines for the backends and pools of the policy and the tenants served most (at
most `2 × MAX_TENANTS`), and for those that left only while their line has a point to draw.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

KEEP_S = 900.0
MAX_TENANTS = 8

Buckets = dict[float, float]  # upper bound -> cumulative count


def counts(families: Iterable[Metric], route_backend: Mapping[str, str]) -> dict[str, Any]:
    """This instant's cumulative counters per backend: requests, latency and TTFT buckets."""
    out: dict[str, Any] = {"requests": {}, "latency": {}, "ttft": {}}
    for fam in families:
        for s in fam.samples:
            lab = s.labels
            if fam.name == "sluice_requests" and s.name.endswith("_total"):
                b = lab.get("backend", "")
                if b:
                    out["requests"][b] = out["requests"].get(b, 0.0) + s.value
            elif s.name.endswith("_bucket") and fam.name in (
                "sluice_request_duration_seconds",
                "sluice_time_to_first_token_seconds",
            ):
                if fam.name == "sluice_request_duration_seconds":
                    kind, b = "latency", route_backend.get(lab.get("route", ""), "")
                else:
                    kind, b = "ttft", lab.get("backend", "")
                if not b:
                    continue
                le = float(lab.get("le", "inf"))
                hist: Buckets = out[kind].setdefault(b, {})
                hist[le] = hist.get(le, 0.0) + s.value
    return out


def p99_ms(now: Buckets | None, before: Buckets | None) -> float | None:
    """The p99 of what fell in the buckets between two samples (ms; None: nothing fell)."""
    if not now:
        return None
    before = before or {}
    bounds = sorted(now)
    total = now[bounds[-1]] - before.get(bounds[-1], 0.0)
    if total <= 0:
        return None
    for le in bounds:
        if now[le] - before.get(le, 0.0) >= 0.99 * total:
            return None if le == float("inf") else le * 1000
    return None  # pragma: no cover - the +Inf bucket always reaches the total


class Series:
    """The charts' points, appended by `sample` (the status board's task)."""

    def __init__(self, sample_s: float) -> None:
        self.step_s = sample_s
        n = max(2, int(KEEP_S / sample_s))
        self.t: deque[float] = deque(maxlen=n)
        self.n = n
        self.backends: dict[str, dict[str, deque[float | None]]] = {}
        self.queues: dict[str, deque[float | None]] = {}
        self.tenants: dict[str, deque[float | None]] = {}
        self.last: dict[str, Any] | None = None
        self.last_t = 0.0
        self.last_served: dict[str, float] = {}

    def _line(self, table: dict[str, deque[float | None]], key: str) -> deque[float | None]:
        line = table.get(key)
        if line is None:
            line = table[key] = deque([None] * (len(self.t) - 1), maxlen=self.n)
        return line

    def sample(self, now: float, c: dict[str, Any], doc: Mapping[str, Any]) -> None:
        last, dt = self.last, now - self.last_t
        self.last, self.last_t = c, now
        if last is None or dt <= 0:
            self.last_served = _served(doc)
            return
        self.t.append(now)
        names = {b.get("name") for b in doc.get("backends", {}).get("backends", [])}
        for b in sorted(n for n in names if isinstance(n, str)):
            lines = self.backends.setdefault(b, {})
            rps = (c["requests"].get(b, 0.0) - last["requests"].get(b, 0.0)) / dt
            self._line(lines, "rps").append(round(rps, 2))
            self._line(lines, "p99_ms").append(p99_ms(c["latency"].get(b), last["latency"].get(b)))
            self._line(lines, "ttft_p99_ms").append(p99_ms(c["ttft"].get(b), last["ttft"].get(b)))
        pools = {str(p.get("pool")): p for p in doc.get("admission", {}).get("pools", [])}
        for name, p in pools.items():
            self._line(self.queues, name).append(float(p.get("queued", 0)))
        served = _served(doc)
        delta = {k: v - self.last_served.get(k, 0.0) for k, v in served.items()}
        self.last_served = served
        total = sum(v for v in delta.values() if v > 0)
        for k in sorted(served, key=lambda k: -served[k])[:MAX_TENANTS]:
            if k not in self.tenants and len(self.tenants) < 2 * MAX_TENANTS:
                self._line(self.tenants, k)  # at most twice the tenants shown at a time
        for k, line in self.tenants.items():
            share = max(delta.get(k, 0.0), 0.0) / total if total else None
            line.append(None if share is None else round(share, 4))
        # A gap in the lines that got no point this time (a backend or pool that left): the
        # lines stay in step with `t` (padding up to its length stops once the window is full).
        for b, lines in self.backends.items():
            if b not in names:
                for line in lines.values():
                    line.append(None)
        for k, line in self.queues.items():
            if k not in pools:
                line.append(None)
        self._forget(names, pools, served)

    def _forget(
        self, backends: Collection[object], pools: Collection[str], tenants: Collection[str]
    ) -> None:
        """Drop the lines of backends, pools and tenants that are gone (not in this sample)
        and have nothing left to draw in the window: a renamed backend or pool, a tenant that
        stopped, go after `KEEP_S`, and a new top tenant takes the place of one that left."""
        for b in [b for b, ls in self.backends.items() if b not in backends and
                  not any(_drawn(line) for line in ls.values())]:  # fmt: skip
            del self.backends[b]
        for table, now in ((self.queues, pools), (self.tenants, tenants)):
            for k in [k for k, line in table.items() if k not in now and not _drawn(line)]:
                del table[k]

    def state(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "t": list(self.t),
            "backends": {b: {k: list(v) for k, v in ls.items()} for b, ls in self.backends.items()},
            "queues": {k: list(v) for k, v in self.queues.items()},
            "tenants": {k: list(v) for k, v in self.tenants.items()},
        }


def _drawn(line: Iterable[float | None]) -> bool:
    """The line has a point worth drawing (not only gaps and zeros)."""
    return any(v for v in line)


def _served(doc: Mapping[str, Any]) -> dict[str, float]:
    """Tokens served so far per tenant, summed over the pools (the state's top tenants)."""
    out: dict[str, float] = {}
    for p in doc.get("admission", {}).get("pools", []):
        for t in p.get("tenants", []):
            k = str(t.get("tenant"))
            out[k] = out.get(k, 0.0) + float(t.get("served_tokens", 0))
    return out
