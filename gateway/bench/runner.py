"""One `sluice bench` run: start the backends, nginx and the gateway, then measure every row.

`measure` brackets a load run with the CPU readings; `run_all` decides which rows exist and owns
their order. Starting and stopping processes is `procs.py`'s job, the load commands `loads.py`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.bench.loads import (
    INFER,
    MakeCmd,
    Parse,
    grpc_load,
    grpc_ok,
    parse_wrk,
    run_load,
    wrk_cmd,
)
from gateway.bench.procs import (
    Procs,
    core_ticks,
    cpu_list,
    cpu_seconds,
    free_port,
    http_get,
    http_ok,
    models_ok,
    pinned,
    start_nginx,
    wait_until,
)
from gateway.bench.report import WARMUP_S, Row, access_log_tally

RunRow = Callable[[Row, MakeCmd, Parse, int | None], Row]

BackendStats = Callable[[], tuple[int, int]]  # the mock backend's (completed, failed) so far


@dataclass
class Setup:
    args: argparse.Namespace
    procs: Procs
    notes: list[str] = field(default_factory=list)

    @property
    def gw_cpus(self) -> str:
        return str(self.args.gateway_cpus)

    @property
    def load_cpus(self) -> str:
        return str(self.args.load_cpus)

    def wrk(self, url: str) -> MakeCmd:
        return wrk_cmd(self.load_cpus, self.args.connections, url)

    def grpc(self, name: str, port: int) -> tuple[MakeCmd, Parse]:
        a = self.args
        return grpc_load(
            self.procs.tmp, self.load_cpus, a.grpc_connections, a.grpc_streams, name, port
        )


def measure(
    row: Row,
    make_cmd: MakeCmd,
    parse: Parse,
    duration: int,
    proxy_pid: int | None,
    cores: set[int],
    backend_stats: BackendStats | None = None,
) -> Row:
    """Warm up, then the measured run with the CPU of `proxy_pid` and of the proxy `cores` read
    around it (and the backend's own counters, if `backend_stats` is given). Errors land in `row`.
    """
    try:
        run_load(make_cmd(WARMUP_S), WARMUP_S)
        row.cmd = make_cmd(duration)
        stats0 = backend_stats() if backend_stats else (0, 0)
        core0, cpu0 = core_ticks(cores), cpu_seconds(proxy_pid) if proxy_pid else 0.0
        out = run_load(row.cmd, duration)
        core1, cpu1 = core_ticks(cores), cpu_seconds(proxy_pid) if proxy_pid else 0.0
        stats1 = backend_stats() if backend_stats else (0, 0)
        parse(out, row)
        if proxy_pid and row.requests:
            row.cpu_us_per_req = (cpu1 - cpu0) / row.requests * 1e6
        if core1[1] > core0[1]:
            own = (cpu1 - cpu0) * os.sysconf("SC_CLK_TCK")
            row.other_pct = max(0.0, (core1[0] - core0[0] - own) / (core1[1] - core0[1]) * 100)
        if backend_stats:
            row.backend_completed, row.backend_failed = (
                stats1[0] - stats0[0],
                stats1[1] - stats0[1],
            )
            row.failed += row.backend_failed
    except Exception as e:
        row.error = str(e).strip()
    return row


def mock_stats(admin_port: int) -> BackendStats:
    """A function returning (completed, failed) from the mock backend's /admin/stats."""

    def read() -> tuple[int, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/admin/stats", timeout=2) as r:
            d = json.loads(r.read())
        return int(d["completed"]), int(d["failed"])

    return read


def policy_doc(
    ports: dict[str, int],
    http_backend: int | None,
    grpc_backend: int | None,
    access_log: bool,
    engine: str = "aiohttp",
    tracing: bool = False,
) -> dict[str, Any]:
    backends: list[dict[str, Any]] = []
    routes: list[dict[str, Any]] = []
    listeners: dict[str, Any] = {"http": None, "grpc": None}
    listeners["admin"] = {"host": "127.0.0.1", "port": ports["admin"]}
    if grpc_backend is not None:
        listeners["grpc"] = {"host": "127.0.0.1", "port": ports["grpc"]}
        backends.append(
            {
                "name": "bench-grpc",
                "protocol": "grpc",
                "endpoints": [{"address": f"127.0.0.1:{grpc_backend}"}],
                "unary_methods": [INFER],
            }
        )
        routes.append({"name": "grpc", "match": {"protocol": "grpc"}, "backend": "bench-grpc"})
    if http_backend is not None:
        listeners["http"] = {"host": "127.0.0.1", "port": ports["http"], "engine": engine}
        backends.append(
            {
                "name": "bench-http",
                "protocol": "http",
                "endpoints": [{"address": f"127.0.0.1:{http_backend}"}],
            }
        )
        routes.append(
            {
                "name": "http",
                "match": {"protocol": "http", "path_prefix": "/"},
                "backend": "bench-http",
            }
        )
    doc = {
        "version": 1,
        "listeners": listeners,
        "backends": backends,
        "routes": routes,
        "access_log": {"enabled": access_log},
        "mock_backend": {"enabled": False},
    }
    if tracing:  # tail sampling as shipped: OK requests are not kept, nothing is exported
        doc["tracing"] = {"enabled": True, "sample_ratio": 1e-5, "slow_ms": 2000}
    from gateway.policy.model import Policy

    Policy.model_validate(doc)  # fail here, with the reason, rather than in the child
    return doc


def start_mock(s: Setup) -> tuple[int, int, int]:
    """`sluice mock-backend` with no delays; ready once a unary Infer returns grpc-status OK.
    Returns its HTTP, gRPC and admin ports."""
    http, grpc_port, admin = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "gateway", "mock-backend"]
    cmd += ["--http", f"127.0.0.1:{http}", "--grpc", f"127.0.0.1:{grpc_port}"]
    cmd += ["--admin", f"127.0.0.1:{admin}"]
    cmd += ["--ttft-ms", "0", "--token-delay-ms", "0", "--log-level", "WARNING"]
    p = s.procs.start("mock-backend", pinned(s.load_cpus, cmd))
    try:
        wait_until("mock backend gRPC", lambda: grpc_ok(f"127.0.0.1:{grpc_port}"), [p])
        wait_until(
            "mock backend HTTP", lambda: models_ok(f"http://127.0.0.1:{http}/v1/models"), [p]
        )
    except Exception as e:
        raise RuntimeError(f"{e}\n{s.procs.tail('mock-backend')}") from e
    return http, grpc_port, admin


def start_gateway(
    s: Setup,
    http_backend: int | None,
    grpc_backend: int | None,
    tracing: bool = False,
    name: str = "gateway",
    edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    ports = {"http": free_port(), "grpc": free_port(), "admin": free_port()}
    doc = policy_doc(
        ports, http_backend, grpc_backend, not s.args.no_access_log, s.args.engine, tracing
    )
    if edit is not None:
        doc = edit(doc)
    path = s.procs.tmp / f"bench-policy-{name}.yaml"
    path.write_text(json.dumps(doc, indent=2) + "\n")  # JSON is YAML
    cmd = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--log-level", "INFO"]
    p = s.procs.start(name, pinned(s.gw_cpus, cmd))
    try:
        wait_until(name, lambda: http_ok(f"http://127.0.0.1:{ports['admin']}/readyz"), [p])
    except Exception as e:
        raise RuntimeError(f"{e}\n{s.procs.tail(name)}") from e
    return p, ports


def run_all(s: Setup) -> list[Row]:
    """Start the backends, the proxies and the gateway, then measure every row in order."""
    a = s.args
    do_http, do_grpc = a.only in (None, "http"), a.only in (None, "grpc")
    have_nginx = shutil.which("nginx") is not None
    http_be = mock_grpc = None
    mock_http: int | None = None
    mock_admin: int | None = None
    if do_grpc or (do_http and not have_nginx):
        mock_http, mock_grpc, mock_admin = start_mock(s)
    if do_http and not shutil.which("wrk"):
        raise RuntimeError("wrk not found (Debian package wrk)")
    proxy: tuple[subprocess.Popen[bytes], int] | None = None
    if do_http:
        if have_nginx:
            http_be = start_nginx(s.procs, "nginx-backend", s.load_cpus, None)[1]
            proxy = start_nginx(s.procs, "nginx-proxy", s.gw_cpus, http_be)
        else:
            http_be = mock_http
            s.notes.append("nginx not found: HTTP backend is `sluice mock-backend`, no nginx row")

    gw: subprocess.Popen[bytes] | None = None
    gw_ports: dict[str, int] = {}
    gw_error: str | None = None
    try:
        gw, gw_ports = start_gateway(s, http_be if do_http else None, mock_grpc)
    except Exception as e:
        gw_error = f"gateway did not start: {e}"

    # --tracing: a second gateway, the same policy plus tail sampling, measured right after.
    traced: list[tuple[str, subprocess.Popen[bytes] | None, dict[str, int], str | None]] = [
        ("", gw, gw_ports, gw_error)
    ]
    if a.tracing:
        try:
            tg, tports = start_gateway(
                s, http_be if do_http else None, mock_grpc, True, "gateway-traced"
            )
            traced.append((" + tail sampling", tg, tports, None))
        except Exception as e:
            traced.append((" + tail sampling", None, {}, f"gateway did not start: {e}"))

    cores = cpu_list(s.gw_cpus)
    stats = mock_stats(mock_admin) if mock_admin is not None else None

    def run(
        row: Row, cmd: MakeCmd, parse: Parse, pid: int | None, backend: BackendStats | None = None
    ) -> Row:
        return measure(row, cmd, parse, a.duration, pid, cores, backend)

    rows: list[Row] = []
    if do_http:
        kind = "nginx" if have_nginx else "mock-backend"
        url = f"http://127.0.0.1:{http_be}/v1/models"
        rows.append(run(Row(f"HTTP backend direct ({kind})"), s.wrk(url), parse_wrk, None))
        if proxy is not None:
            url = f"http://127.0.0.1:{proxy[1]}/v1/models"
            rows.append(run(Row("HTTP nginx proxy"), s.wrk(url), parse_wrk, proxy[0].pid))
        for suffix, g, g_ports, g_error in traced:
            row = Row(f"HTTP Sluice ({a.engine}){suffix}")
            if g is None:
                row.error = g_error
            else:
                url = f"http://127.0.0.1:{g_ports['http']}/v1/models"
                if not models_ok(url):
                    status, body = http_get(url)
                    row.error = f"probe GET {url} → {status} {body[:200]!r}"
                else:
                    run(row, s.wrk(url), parse_wrk, g.pid)
            rows.append(row)
        if a.auth:
            rows += auth_rows(s, http_be, run)
    if do_grpc:
        assert mock_grpc is not None
        cmd, parse = s.grpc("grpc-direct", mock_grpc)
        rows.append(run(Row("gRPC backend direct (mock)"), cmd, parse, None, stats))
        for suffix, g, g_ports, g_error in traced:
            row = Row(f"gRPC Sluice{suffix}")
            if g is None:
                row.error = g_error
            else:
                try:
                    grpc_ok(f"127.0.0.1:{g_ports['grpc']}")
                except Exception as e:
                    row.error = f"probe Infer through Sluice: {e}"
                else:
                    cmd, parse = s.grpc(
                        "grpc-sluice" + ("-traced" if suffix else ""), g_ports["grpc"]
                    )
                    run(row, cmd, parse, g.pid, stats)
            rows.append(row)
    if gw is not None:
        if gw.poll() is not None:
            s.notes.append(f"the gateway exited during the run:\n{s.procs.tail('gateway')}")
        elif not a.no_access_log:
            s.notes.append(access_log_tally(s.procs.tmp / "gateway.log"))
    return rows


def auth_rows(s: Setup, http_be: int | None, run: RunRow) -> list[Row]:
    """The JWT rows (gateway/bench/auth.py), through a second gateway started for them."""
    from gateway.bench import auth

    names = {
        "off": "HTTP auth on, route off (token sent)",
        "cached": "HTTP auth on, cached token",
        "RS256": "HTTP auth on, fresh RS256 token",
        "ES256": "HTTP auth on, fresh ES256 token",
    }
    rows = [Row(n) for n in names.values()]
    try:
        files = auth.prepare(s.procs.tmp)
        gw, ports = start_gateway(
            s, http_be, None, name="gateway-auth", edit=lambda d: auth.with_auth(d, files)
        )
    except Exception as e:
        for r in rows:
            r.error = f"auth gateway did not start: {e}"
        return rows
    base = f"http://127.0.0.1:{ports['http']}"
    for row, variant in zip(rows, names, strict=True):
        url = f"{base}/off/v1/models" if variant == "off" else f"{base}/v1/models"
        extra = auth.wrk_args(files, "cached" if variant == "off" else variant)
        run(row, wrk_cmd(s.load_cpus, s.args.connections, url, extra), parse_wrk, gw.pid)
        if row.error is None and row.requests and row.failed > row.requests // 100:
            row.error = f"{row.failed} of {row.requests} requests failed (auth refused?)"
    off, cached = rows[0], rows[1]
    if off.cpu_us_per_req and cached.cpu_us_per_req:
        delta = cached.cpu_us_per_req - off.cpu_us_per_req
        s.notes.append(
            f"auth: checking a cached token costs {delta:+.1f} µs/req over the same request on a "
            "route with auth off (budget ≤ 3)"
        )
    return rows
