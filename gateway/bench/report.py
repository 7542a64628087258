"""Results of `sluice bench`: the `Row` of one measured run, the ratios and verdicts, the table.

Pure: rows in, values and lines out (the access-log tally only reads the file it is given).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The hot-path targets as multiples of the floor's CPU per request in the same run (POST). The
# verdicts are all ratios ("Benchmarks" in docs/contributing.md): the absolute µs targets the bench
# once printed (60 per HTTP request, 300 per gRPC call) were not the design's, and a figure in µs
# says little from one machine to the next.
FLOOR_TARGETS = {"native": 2.0, "native, full chain": 3.0, "aiohttp, full chain": 4.5}
# HTTP/2 (h2c) on the native engine: at most 2.5 × the same gateway's HTTP/1.1 CPU per request,
# or, where python-hyper h2's own cost puts that out of reach, 1.5 × the HTTP/2 floor's
# (`gateway.bench.h2floor`: h2 on asyncio and nothing else, measured with the same h2load).
H2_VS_HTTP1_TARGET = 2.5
H2_VS_FLOOR_TARGET = 1.5
GRPC_H2_TARGET = 0.6  # gRPC unary on the h2 engine: at most 0.6 × grpc.aio's CPU per call
WARMUP_S = 2


@dataclass
class Row:
    """One measured run. `error` set means no figures (the reason is printed instead)."""

    name: str
    cmd: list[str] = field(default_factory=list)
    requests: int = 0
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    cpu_us_per_req: float | None = None
    failed: int = 0  # non-2xx, socket errors, failed streams, backend-counted failures
    other_pct: float | None = None  # busy share of the proxy cores not spent by the proxy
    backend_completed: int | None = None  # the mock backend's own count (gRPC rows)
    backend_failed: int | None = None
    error: str | None = None


def access_log_tally(path: Path) -> str:
    """How many requests the gateway's access log holds, and how many of them were errors."""
    total = errors = cancelled = 0
    with open(path, errors="replace") as f:
        for line in f:
            if '"request_id"' not in line:
                continue
            try:
                e = json.loads(line)
            except ValueError:
                continue
            total += 1
            if e.get("cancelled"):
                cancelled += 1
                continue
            status, grpc_status = e.get("status"), e.get("grpc_status")
            if grpc_status is not None:
                errors += grpc_status != 0
            elif not isinstance(status, int) or not 100 <= status < 400:
                errors += 1
    return (
        f"Sluice access log: {total} requests, {errors} errors (HTTP status not 1xx-3xx, or "
        f"grpc-status ≠ 0), {cancelled} cancelled by the client (in flight when a run ended)"
    )


def _by_name(rows: list[Row], prefix: str) -> Row | None:
    return next((r for r in rows if r.name.startswith(prefix) and r.error is None), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(rows: list[Row]) -> dict[str, Any]:
    """Ratios and verdicts from the rows that have figures (HTTP: per engine row)."""
    out: dict[str, Any] = {}
    direct, nginx, floor = (
        _by_name(rows, "HTTP backend direct"),
        _by_name(rows, "HTTP nginx proxy"),
        _by_name(rows, "HTTP floor"),
    )
    for r in rows:
        if not r.name.startswith("HTTP Sluice") or r.error is not None:
            continue
        engine = r.name.partition("(")[2].rstrip(")") or "sluice"
        out[f"http_{engine}"] = {
            "cpu_us": r.cpu_us_per_req,
            "rps_vs_direct": _ratio(r.rps, direct.rps if direct else None),
            "cpu_vs_nginx": _ratio(r.cpu_us_per_req, nginx.cpu_us_per_req if nginx else None),
            "cpu_vs_floor": _ratio(r.cpu_us_per_req, floor.cpu_us_per_req if floor else None),
            "floor_target": FLOOR_TARGETS.get(engine),
        }
    if floor and nginx:
        out["http_floor_vs_nginx"] = _ratio(floor.cpu_us_per_req, nginx.cpu_us_per_req)
    h2floor = _by_name(rows, "HTTP/2 floor")
    h2floor_us = h2floor.cpu_us_per_req if h2floor else None
    if h2floor and floor:
        out["http2_floor_vs_floor"] = _ratio(h2floor.cpu_us_per_req, floor.cpu_us_per_req)
    for r in rows:
        if not r.name.startswith("HTTP/2 Sluice") or r.error is not None:
            continue
        engine = r.name.partition("(")[2].rstrip(")") or "sluice"
        http1 = _by_name(rows, "HTTP Sluice" + r.name[len("HTTP/2 Sluice") :])
        out[f"h2_{engine}"] = {
            "cpu_us": r.cpu_us_per_req,
            "cpu_vs_http1": _ratio(r.cpu_us_per_req, http1.cpu_us_per_req if http1 else None),
            "cpu_vs_h2_floor": _ratio(r.cpu_us_per_req, h2floor_us),
        }
    gdirect, gsluice = _by_name(rows, "gRPC backend direct"), _by_name(rows, "gRPC Sluice")
    if gsluice:
        out["grpc_rps_vs_direct"] = _ratio(gsluice.rps, gdirect.rps if gdirect else None)
        out["grpc_cpu_us"] = gsluice.cpu_us_per_req
    aio, h2 = _by_name(rows, "gRPC Sluice (grpcio"), _by_name(rows, "gRPC Sluice (h2")
    if aio and h2:
        ratio = _ratio(h2.cpu_us_per_req, aio.cpu_us_per_req)
        out["grpc_h2_vs_grpcio"] = ratio
        out["grpc_h2_pass"] = None if ratio is None else ratio <= GRPC_H2_TARGET
    return out


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def render(rows: list[Row], summ: dict[str, Any], notes: list[str], duration: int) -> Iterator[str]:
    yield f"sluice bench: {duration} s per measured run, each after a {WARMUP_S} s warm-up run"
    for n in notes:
        yield f"  note: {n}"
    yield ""
    w = max(len(r.name) for r in rows) + 2
    yield (
        f"{'':{w}}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'proxy CPU µs/req':>18}{'failed':>8}"
        f"{'other %':>9}"
    )
    for r in rows:
        if r.error is not None:
            yield f"{r.name:{w}}  not measured: {r.error.splitlines()[0]}"
            continue
        yield (
            f"{r.name:{w}}{_f(r.rps, ',.0f'):>10}{_f(r.p50_ms, '.3f'):>9}{_f(r.p99_ms, '.3f'):>9}"
            f"{_f(r.cpu_us_per_req, '.1f'):>18}{r.failed:>8}{_f(r.other_pct, '.0f'):>9}"
        )
    yield (
        "  failed: non-2xx, socket errors, failed streams, and calls the mock backend counted as"
        " failed"
    )
    yield (
        "  other %: busy share of the proxy cores not spent by the proxy process (other processes,"
        " softirq) — high values mean a noisy machine"
    )
    for r in rows:
        if r.backend_completed is not None:
            yield (
                f"  {r.name}: the mock backend counted {r.backend_completed} completed, "
                f"{r.backend_failed} failed (load generator: {r.requests})"
            )
    yield ""
    if "http_floor_vs_nginx" in summ:
        yield f"HTTP  floor µs/req ÷ nginx µs/req:   {_f(summ['http_floor_vs_nginx'], '.2f')}"
    for key, v in summ.items():
        if not key.startswith("http_") or not isinstance(v, dict):
            continue
        name = key[5:]
        yield (
            f"HTTP  Sluice ({name}): req/s ÷ direct {_f(v['rps_vs_direct'], '.2f')}, "
            f"µs/req ÷ nginx {_f(v['cpu_vs_nginx'], '.2f')}, "
            f"÷ floor {_f(v['cpu_vs_floor'], '.2f')}"
        )
        target, ratio = v.get("floor_target"), v["cpu_vs_floor"]
        if target is not None and ratio is not None:
            verdict = "PASS" if ratio <= target else "FAIL"
            yield f"HTTP  verdict ({name}): {ratio:.2f}× the floor vs target ≤ {target} → {verdict}"
    if "http2_floor_vs_floor" in summ:
        yield f"HTTP/2 floor µs/req ÷ HTTP floor µs/req: {_f(summ['http2_floor_vs_floor'], '.2f')}"
    for key, v in summ.items():
        if not key.startswith("h2_") or not isinstance(v, dict):
            continue
        verdicts = []
        for what, ratio, target in (
            ("HTTP/1.1", v["cpu_vs_http1"], H2_VS_HTTP1_TARGET),
            ("the HTTP/2 floor", v["cpu_vs_h2_floor"], H2_VS_FLOOR_TARGET),
        ):
            if ratio is not None:
                verdict = "PASS" if ratio <= target else "FAIL"
                verdicts.append(f"{ratio:.2f}× {what} vs ≤ {target} → {verdict}")
        if verdicts:
            yield f"HTTP/2 Sluice ({key[3:]}): µs/req " + "; ".join(verdicts)
    if "grpc_cpu_us" in summ:
        yield f"gRPC  Sluice req/s ÷ direct req/s:   {_f(summ['grpc_rps_vs_direct'], '.2f')}"
    if summ.get("grpc_h2_pass") is not None:
        verdict = "PASS" if summ["grpc_h2_pass"] else "FAIL"
        yield (
            f"gRPC  h2 engine µs/call ÷ grpc.aio engine µs/call: "
            f"{summ['grpc_h2_vs_grpcio']:.2f} vs target ≤ {GRPC_H2_TARGET} → {verdict}"
        )
    yield ""
    yield "load commands (measured runs):"
    for r in rows:
        if r.cmd:
            yield f"  {r.name}: {' '.join(_quote(c) for c in r.cmd)}"
    for r in rows:
        if r.error is not None and "\n" in r.error:
            yield ""
            yield f"{r.name}: {r.error}"


def _quote(arg: str) -> str:
    return f"'{arg}'" if any(c in arg for c in " \"'$") else arg
