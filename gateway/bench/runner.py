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
from pathlib import Path
from typing import Any

import yaml

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


def mock_stats(http_port: int) -> BackendStats:
    """A function returning (completed, failed) from the mock backend's /admin/stats."""

    def read() -> tuple[int, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/admin/stats", timeout=2) as r:
            d = json.loads(r.read())
        return int(d["completed"]), int(d["failed"])

    return read


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`: mappings merged key by key, anything else replaced."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def policy_doc(
    ports: dict[str, int],
    http_backend: int | None,
    grpc_backend: int | None,
    access_log: bool,
    engine: str = "native",
    filters: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The bench policy; `filters` sets the chain, `extra` (`--policy-extra`) is merged over it
    (the sections a filter needs, e.g. `auth:`), so a new filter needs no change here."""
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
    doc: dict[str, Any] = {
        "version": 1,
        "listeners": listeners,
        "backends": backends,
        "routes": routes,
        "access_log": {"enabled": access_log},
        "mock_backend": {"enabled": False},
    }
    if filters is not None:
        doc["filters"] = filters
    if extra:
        doc = merge(doc, extra)
    from gateway.policy.model import Policy

    Policy.model_validate(doc)  # fail here, with the reason, rather than in the child
    return doc


def start_mock(s: Setup) -> tuple[int, int]:
    """`sluice mock-backend` with no delays; ready once a unary Infer returns grpc-status OK."""
    http, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "gateway", "mock-backend"]
    cmd += ["--http", f"127.0.0.1:{http}", "--grpc", f"127.0.0.1:{grpc_port}"]
    cmd += ["--ttft-ms", "0", "--token-delay-ms", "0", "--log-level", "WARNING"]
    p = s.procs.start("mock-backend", pinned(s.load_cpus, cmd))
    try:
        wait_until("mock backend gRPC", lambda: grpc_ok(f"127.0.0.1:{grpc_port}"), [p])
        wait_until(
            "mock backend HTTP", lambda: models_ok(f"http://127.0.0.1:{http}/v1/models"), [p]
        )
    except Exception as e:
        raise RuntimeError(f"{e}\n{s.procs.tail('mock-backend')}") from e
    return http, grpc_port


def start_gateway(
    s: Setup, http_backend: int | None, grpc_backend: int | None, engine: str
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    a = s.args
    ports = {"http": free_port(), "grpc": free_port(), "admin": free_port()}
    filters = [f for f in a.filters.split(",") if f] if a.filters else None
    extra = yaml.safe_load(Path(a.policy_extra).read_text()) if a.policy_extra else None
    doc = policy_doc(ports, http_backend, grpc_backend, not a.no_access_log, engine, filters, extra)
    name = f"gateway-{engine}"
    path = s.procs.tmp / f"{name}-policy.yaml"
    path.write_text(json.dumps(doc, indent=2) + "\n")  # JSON is YAML
    cmd = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--log-level", "INFO"]
    p = s.procs.start(name, pinned(s.gw_cpus, cmd))
    try:
        wait_until(name, lambda: http_ok(f"http://127.0.0.1:{ports['admin']}/readyz"), [p])
    except Exception as e:
        raise RuntimeError(f"{e}\n{s.procs.tail(name)}") from e
    return p, ports


def start_floor(s: Setup, http_backend: int) -> tuple[subprocess.Popen[bytes], int]:
    """The bare Protocol + httptools proxy (`gateway.bench.floor`), pinned like the proxies."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.bench.floor", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--upstream", f"127.0.0.1:{http_backend}"]
    p = s.procs.start("floor", pinned(s.gw_cpus, cmd))
    url = f"http://127.0.0.1:{port}/v1/models"
    try:
        wait_until("floor proxy", lambda: models_ok(url), [p])
    except Exception as e:
        raise RuntimeError(f"{e}\n{s.procs.tail('floor')}") from e
    return p, port


def run_all(s: Setup) -> list[Row]:
    """Start the backends, the proxies and the gateway, then measure every row in order."""
    a = s.args
    do_http, do_grpc = a.only in (None, "http"), a.only in (None, "grpc")
    have_nginx = shutil.which("nginx") is not None
    http_be = mock_grpc = None
    mock_http: int | None = None
    if do_grpc or (do_http and not have_nginx):
        mock_http, mock_grpc = start_mock(s)
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

    engines = ["native", "aiohttp"] if a.engine == "both" else [a.engine]
    gws: dict[str, tuple[subprocess.Popen[bytes], dict[str, int]]] = {}
    gw_errors: dict[str, str] = {}
    for i, engine in enumerate(engines):  # gRPC is measured through the first one only
        if i > 0 and not do_http:
            break
        try:
            gws[engine] = start_gateway(
                s, http_be if do_http else None, mock_grpc if i == 0 else None, engine
            )
        except Exception as e:
            gw_errors[engine] = f"gateway did not start: {e}"
    floor: tuple[subprocess.Popen[bytes], int] | None = None
    floor_error = ""
    if do_http:
        assert http_be is not None
        try:
            floor = start_floor(s, http_be)
        except Exception as e:
            floor_error = f"floor proxy did not start: {e}"

    cores = cpu_list(s.gw_cpus)
    stats = mock_stats(mock_http) if mock_http is not None else None

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
        row = Row("HTTP floor (Protocol + httptools)")
        if floor is None:
            row.error = floor_error
        else:
            url = f"http://127.0.0.1:{floor[1]}/v1/models"
            run(row, s.wrk(url), parse_wrk, floor[0].pid)
        rows.append(row)
        for engine in engines:
            row = Row(f"HTTP Sluice ({engine})")
            if engine not in gws:
                row.error = gw_errors[engine]
            else:
                p, ports = gws[engine]
                url = f"http://127.0.0.1:{ports['http']}/v1/models"
                if not models_ok(url):
                    status, body = http_get(url)
                    row.error = f"probe GET {url} → {status} {body[:200]!r}"
                else:
                    run(row, s.wrk(url), parse_wrk, p.pid)
            rows.append(row)
    gw = gws.get(engines[0], (None, {}))[0]
    gw_ports = gws.get(engines[0], (None, {}))[1]
    gw_error = gw_errors.get(engines[0])
    if do_grpc:
        assert mock_grpc is not None
        cmd, parse = s.grpc("grpc-direct", mock_grpc)
        rows.append(run(Row("gRPC backend direct (mock)"), cmd, parse, None, stats))
        row = Row("gRPC Sluice")
        if gw is None:
            row.error = gw_error
        else:
            try:
                grpc_ok(f"127.0.0.1:{gw_ports['grpc']}")
            except Exception as e:
                row.error = f"probe Infer through Sluice: {e}"
            else:
                cmd, parse = s.grpc("grpc-sluice", gw_ports["grpc"])
                run(row, cmd, parse, gw.pid, stats)
        rows.append(row)
    for engine, (p, _) in gws.items():
        name = f"gateway-{engine}"
        if p.poll() is not None:
            s.notes.append(f"{name} exited during the run:\n{s.procs.tail(name)}")
        elif not a.no_access_log:
            s.notes.append(f"{engine}: " + access_log_tally(s.procs.tmp / f"{name}.log"))
    if a.filters is not None:
        s.notes.append(f"filters: {a.filters or '(none)'}")
    return rows
