"""`sluice bench`: measure the backend direct and through Sluice in one run, and print the ratios.

    python -m gateway bench [--duration 10] [--only http|grpc] [--json] [--no-access-log]
                            [--engine both|native|aiohttp] [--grpc-engine both|grpcio|h2]
                            [--filters a,b,c ...]
                            [--policy-extra FILE] [--tracing] [--auth]
    python -m tests.bench.run [same options]

Rows, each after a 2 s warm-up run of the same command:

- HTTP backend direct: wrk → nginx returning a fixed `/v1/models` JSON (no nginx on the machine:
  `sluice mock-backend` instead, said in the output).
- HTTP nginx proxy: wrk → nginx `proxy_pass` with a keep-alive upstream → the same backend: the
  reference proxy (~16 µs/req).
- HTTP floor: wrk → `gateway.bench.floor`, a bare asyncio.Protocol + httptools proxy on uvloop
  with a task per request (no policy, no logging) → the same backend: the least a Python proxy
  costs here, the ratios' denominator. HTTP bare callbacks proxy: the same without the task, a
  reference row.
- HTTP/2 floor: h2load (h2c, wrk's requests in flight as streams over `--h2-connections`) →
  `gateway.bench.h2floor`, a bare asyncio.Protocol + python-hyper h2 proxy on uvloop, a task per
  stream, to the same backend over keep-alive HTTP/1.1: the least HTTP/2 in Python costs here,
  the HTTP/2 rows' denominator (measured when the native engine is).
- HTTP Sluice (engine[, chain][, + tail sampling]): wrk → `sluice serve` with a policy written
  here → the same backend. One row per engine (`--engine both`: native and aiohttp) × filter
  chain (`--filters`, repeatable; `default` = the policy's default chain) × tracing (`--tracing`
  adds a row with tail sampling at 1e-5: the OK requests measured are decided and dropped).
  `--policy-extra` is YAML merged over every bench policy (the sections a chain needs). On the
  native engine the same gateway is measured again over h2c with the HTTP/2 floor's h2load
  command (rows "HTTP/2 Sluice"), its CPU per request divided by the HTTP/1.1 row's and by the
  HTTP/2 floor's.
- With `--full`, a row per engine for the full chain (`gateway/bench/full.py`: JWT, two rate-limit
  rules, tail-sampled tracing, breaker + outlier + retries), and each feature's cost in place:
  the full-chain gateway and the one without that feature measured in turn, `--pairs` times
  for `--pair-duration` s each, the median difference printed against the feature's budget
  (`gateway/bench/features.py`).
- With `--rounds N`, the floor, the HTTP/2 floor and a gateway of each HTTP/1.1 Sluice row run
  side by side (the native ones driven over h2c too) and are measured in turn N times; each row's
  median ratio to its floor in the same round is printed against its target
  (`gateway/bench/rounds.py`): on a shared machine the ratio of two runs minutes apart moves
  with the machine. With `--grpc-engine both`, a gateway of each gRPC engine too: the h2
  engine's median ratio to the grpcio engine's CPU per call.
- With `--auth`, HTTP auth rows (`gateway/bench/auth.py`): the same backend through a Sluice
  with an `auth` section: a route with auth off, a cached token, a fresh token per request
  (RS256, ES256). The "HTTP Sluice" row of the same engine, without `auth`, is the baseline.
- gRPC backend direct: h2load (gRPC-framed unary `Infer`) → `sluice mock-backend`.
- gRPC Sluice (grpc engine[, chain][, + tail sampling]): h2load → `sluice serve` → the same
  mock backend, one row per gRPC engine (`--grpc-engine both`: grpcio and h2) × chain × tracing
  (the HTTP engine plays no part); the h2 row's CPU per call ÷ the grpcio row's is reported.

Each Sluice variant runs in its own gateway, started before its row and stopped after it.
Proxy CPU µs/req is utime+stime of the proxy process (and its children) from /proc/PID/stat,
read before and after the measured run, divided by the completed requests. The proxies run on
`--gateway-cpus` (default core 0), load generators and backends on `--load-cpus` (core 1).
Every process started here is stopped (terminate, then kill) and the temp dir removed, whatever
happens; every wait has a deadline.
"""
# Modules: procs (processes, pinning, /proc CPU, readiness, nginx config), loads (wrk, h2load,
# grpc.aio load and their parsers), gateways (mock backend, floors, Sluice and its bench policy),
# runner (the rows of one run), features (--full's paired feature costs), auth (the --auth rows),
# floor and h2floor (the floor proxies), report (Row, ratios, table).
# This module is the CLI edge: `configure(parser)` and `run(args)`, as gateway/cli.py expects.

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from types import FrameType

from gateway.bench.procs import Procs, check_pinning, wait_idle
from gateway.bench.report import render, summary
from gateway.bench.runner import Setup, run_all

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=int, default=10, help="seconds per measured run")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections (HTTP)")
    parser.add_argument(
        "--h2-connections",
        type=int,
        default=4,
        help="h2load -c of the HTTP/2 rows (h2c); -m is --connections ÷ this",
    )
    parser.add_argument("--grpc-connections", type=int, default=4, help="h2load -c (gRPC)")
    parser.add_argument("--grpc-streams", type=int, default=16, help="h2load -m per connection")
    parser.add_argument("--only", choices=("http", "grpc"), help="measure one protocol only")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument(
        "--no-access-log", action="store_true", help="run Sluice with access_log.enabled false"
    )
    parser.add_argument(
        "--engine",
        choices=("both", "native", "aiohttp"),
        default="both",
        help="Sluice's HTTP ingress engine (listeners.http.engine); both: one row each",
    )
    parser.add_argument(
        "--grpc-engine",
        choices=("both", "grpcio", "h2"),
        default="both",
        help="Sluice's gRPC engine (listeners.grpc.engine); both: one row each",
    )
    parser.add_argument(
        "--filters",
        metavar="A,B,C",
        action="append",
        help="a filter chain to measure (policy `filters:`, e.g. request_id,route; `default`: "
        "the default chain); repeat for one row per chain",
    )
    parser.add_argument(
        "--policy-extra",
        metavar="FILE",
        help="YAML merged over the bench policy (the sections --filters need, e.g. auth:)",
    )
    parser.add_argument(
        "--method",
        choices=("post", "get"),
        default="post",
        help="HTTP rows: a ~200 B chat completion POST (default) or GET /v1/models",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="add a full-chain row per engine (JWT, two rate-limit rules, tail-sampled tracing, "
        "breaker, outlier, retries: gateway.bench.full)",
    )
    parser.add_argument(
        "--no-leave-one-out",
        action="store_true",
        help="with --full: skip measuring each feature's cost in place (the full chain against "
        "the chain without that feature, in pairs: gateway.bench.features)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=3,
        help="with --full: runs of each (full chain, chain without one feature) pair; a "
        "feature's cost is the median of the pairs' differences",
    )
    parser.add_argument(
        "--features",
        default="",
        help="with --full: the features to measure in pairs, comma-separated (auth, rate_limits, "
        "budgets, tracing, resilience; default all), and `control`: the full chain against a "
        "second copy of itself, the method's own offset and spread",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="also measure the floors and each Sluice row (HTTP/1.1, and HTTP/2 on the native "
        "engine) in turn this many times, `--pair-duration` s each, and print each row's median "
        "ratio to its floor; with --grpc-engine both, the two gRPC engines too "
        "(gateway.bench.rounds)",
    )
    parser.add_argument(
        "--pair-duration",
        type=int,
        default=4,
        help="seconds of each measured run of a pair (after the usual warm-up)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="run the Sluice HTTP gateways with `sluice serve --workers N` (CPU: all workers)",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also measure a gateway with tail-sampled tracing on (rows '+ tail sampling')",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="add the JWT rows (a second Sluice with an auth section: route off, cached token, "
        "fresh RS256 / ES256 token per request)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=30.0,
        help="wait up to this many seconds for the machine to be quiet before starting",
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the temp dir (process logs, policy, ...)"
    )
    parser.add_argument(
        "--gateway-cpus", default="0", help="taskset -c list for the proxies ('' = no pinning)"
    )
    parser.add_argument(
        "--load-cpus",
        default="1",
        help="taskset -c list for load generators and backends ('' = no pinning)",
    )


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the children


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every row was measured (whatever the verdict), 1 otherwise."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    notes: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    procs = Procs(tmp)
    try:
        check_pinning(args, notes)
        wait_idle(args.wait_idle, notes)
        from gateway import native

        notes.append(f"Sluice request path: {native.STATE} (gateway.native)")
        if not args.no_access_log:
            notes.append("Sluice access log on (stderr to a temp file); --no-access-log: off")
        if args.keep_logs:
            notes.append(f"process logs, policy and h2load logs kept in {tmp}")
        try:
            rows = run_all(Setup(args, procs, notes))
        except Exception as e:
            print(f"sluice bench: {e}", file=sys.stderr)
            return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut cleanup
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
        if not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
    summ = summary(rows)
    for line in render(rows, summ, notes, args.duration):
        print(line)
    if args.json:
        doc = {"rows": [asdict(r) for r in rows], "summary": summ, "notes": notes}
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    return 1 if any(r.error is not None for r in rows) else 0
