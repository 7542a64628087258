"""One `sluice bench` run: start the backends and the proxies, then measure every row in order.

`measure` brackets a load run with the CPU readings; `run_all` decides which rows exist and owns
their order. Each Sluice variant (engine × `--filters` chain × `--tracing`) gets its own gateway,
started just before its row and stopped right after, so no idle gateway shares the proxy core.
The processes and the bench policy are `gateways.py`'s job, the load commands `loads.py`'s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

from gateway.bench.gateways import (
    BackendStats,
    Setup,
    Variant,
    mock_stats,
    parse_chains,
    start_floor,
    start_gateway,
    start_h2floor,
    start_mock,
)
from gateway.bench.loads import (
    MakeCmd,
    Parse,
    grpc_ok,
    parse_wrk,
    run_load,
)
from gateway.bench.procs import (
    core_ticks,
    cpu_list,
    cpu_seconds,
    http_get,
    models_ok,
    start_nginx,
)
from gateway.bench.report import WARMUP_S, Row, access_log_tally

__all__ = ["Setup", "measure", "run_all"]

H2_CONNECTIONS = 4  # the HTTP/2 rows: wrk's connections as streams over this many connections


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


# Measures a started gateway: (its process, its ports) → the row filled in (or its error set).
Probe = Callable[[subprocess.Popen[bytes], dict[str, int]], None]


def gateway_row(
    s: Setup,
    row: Row,
    variant: Variant,
    backends: tuple[int | None, int | None],
    probe: Probe,
) -> Row:
    """Start the gateway of `variant`, measure `row` through it, note its access log, stop it."""
    name = f"gateway-{len(s.procs.children)}"
    try:
        p, ports = start_gateway(s, backends[0], backends[1], variant, name)
    except Exception as e:
        row.error = f"gateway did not start: {e}"
        return row
    try:
        probe(p, ports)
        if p.poll() is not None:
            s.notes.append(f"{row.name}: the gateway exited during the run:\n{s.procs.tail(name)}")
        elif not s.args.no_access_log and (variant.chain is None or "access_log" in variant.chain):
            s.notes.append(f"{row.name}: " + access_log_tally(s.procs.tmp / f"{name}.log"))
    finally:
        s.procs.stop(p)
    return row


def run_all(s: Setup) -> list[Row]:
    """Start the backends and the proxies, then measure every row in order."""
    a = s.args
    do_http, do_grpc = a.only in (None, "http"), a.only in (None, "grpc")
    have_nginx = shutil.which("nginx") is not None
    if do_http and not shutil.which("wrk"):
        raise RuntimeError("wrk not found (Debian package wrk)")
    mock_http = mock_grpc = mock_admin = None
    if do_grpc or (do_http and not have_nginx):
        mock_http, mock_grpc, mock_admin = start_mock(s)
    engines = ["native", "aiohttp"] if a.engine == "both" else [a.engine]
    chains = parse_chains(a.filters)
    tracings = [False, True] if a.tracing else [False]
    cores = cpu_list(s.gw_cpus)

    def run(
        row: Row,
        cmd: MakeCmd,
        parse: Parse,
        pid: int | None,
        backend: BackendStats | None = None,
        duration: int | None = None,
    ) -> Row:
        return measure(row, cmd, parse, duration or a.duration, pid, cores, backend)

    rows: list[Row] = []
    if do_http:
        rows += http_rows(s, run, engines, chains, tracings, have_nginx, mock_http)
    if do_grpc:
        assert mock_grpc is not None and mock_admin is not None
        stats = mock_stats(mock_admin)
        cmd, parse = s.grpc("grpc-direct", mock_grpc)
        rows.append(run(Row("gRPC backend direct (mock)"), cmd, parse, None, stats))
        grpc_engines = ["grpcio", "h2"] if a.grpc_engine == "both" else [a.grpc_engine]
        for v in (
            Variant(None, chain, tracing, grpc_engine)
            for chain in chains
            for tracing in tracings
            for grpc_engine in grpc_engines
        ):
            row = Row(f"gRPC Sluice {v.label}".rstrip())

            def probe(p: subprocess.Popen[bytes], ports: dict[str, int], row: Row = row) -> None:
                try:
                    grpc_ok(f"127.0.0.1:{ports['grpc']}")
                except Exception as e:
                    row.error = f"probe Infer through Sluice: {e}"
                    return
                cmd, parse = s.grpc(f"grpc-sluice-{len(rows)}", ports["grpc"])
                run(row, cmd, parse, p.pid, stats)

            rows.append(gateway_row(s, row, v, (None, mock_grpc), probe))
        if getattr(a, "rounds", 0) > 0 and a.grpc_engine == "both":
            from gateway.bench.rounds import grpc_round_ratios

            def measure_grpc(row: Row, cmd: MakeCmd, parse: Parse, pid: int) -> Row:
                return run(row, cmd, parse, pid, stats, a.pair_duration)

            grpc_round_ratios(s, mock_grpc, chains[0], a.rounds, measure_grpc)
    return rows


def http_rows(
    s: Setup,
    run: Callable[..., Row],  # run_all's `run`
    engines: list[str],
    chains: list[tuple[str, ...] | None],
    tracings: list[bool],
    have_nginx: bool,
    mock_http: int | None,
) -> list[Row]:
    """Backend direct, nginx proxy, floor, one Sluice row per variant, then `--auth`'s rows."""
    if have_nginx:
        http_be = start_nginx(s.procs, "nginx-backend", s.load_cpus, None)[1]
        proxy = start_nginx(s.procs, "nginx-proxy", s.gw_cpus, http_be)
    else:
        assert mock_http is not None
        http_be, proxy = mock_http, None
        s.notes.append("nginx not found: HTTP backend is `sluice mock-backend`, no nginx row")
    kind = "nginx" if have_nginx else "mock-backend"
    rows = [run(Row(f"HTTP backend direct ({kind})"), s.wrk(s.url(http_be)), parse_wrk, None)]
    if proxy is not None:
        rows.append(run(Row("HTTP nginx proxy"), s.wrk(s.url(proxy[1])), parse_wrk, proxy[0].pid))
    # The floor (the ratios' denominator) and, for reference, the same proxy without its task
    # per request; that row's name does not start with "HTTP floor".
    for name, callbacks in (
        ("HTTP floor (Protocol + httptools, a task per request)", False),
        ("HTTP bare callbacks proxy (the floor without a task)", True),
    ):
        row = Row(name)
        try:
            floor, port = start_floor(s, http_be, callbacks)
        except Exception as e:
            row.error = f"floor proxy did not start: {e}"
        else:
            run(row, s.wrk(s.url(port)), parse_wrk, floor.pid)
            s.procs.stop(floor)
        rows.append(row)

    def h2c(name: str, url: str, headers: list[str]) -> tuple[MakeCmd, Parse]:
        """The HTTP/2 rows' h2load: as many requests in flight as wrk's, over fewer connections."""
        conns = getattr(s.args, "h2_connections", H2_CONNECTIONS)  # tests build partial args
        return s.h2load(name, url, headers, conns, max(1, s.args.connections // conns))

    h2 = shutil.which("h2load") is not None
    if h2 and "native" in engines:  # the HTTP/2 floor: the HTTP/2 rows' denominator
        row = Row("HTTP/2 floor (Protocol + h2, a task per stream)")
        try:
            h2floor, port = start_h2floor(s, http_be)
        except Exception as e:
            row.error = f"h2 floor proxy did not start: {e}"
        else:
            cmd, parse = h2c("h2-floor", s.url(port), [])
            run(row, cmd, parse, h2floor.pid)
            s.procs.stop(h2floor)
        rows.append(row)

    def probe(row: Row, h2row: Row | None, variant: Variant) -> Probe:
        variant_headers = s.headers(variant)

        def go(p: subprocess.Popen[bytes], ports: dict[str, int]) -> None:
            probe_url = _models(ports["http"])
            sent = dict([h.split(": ", 1) for h in variant_headers[1::2]])
            if not models_ok(probe_url, sent):
                status, body = http_get(probe_url, sent)
                row.error = f"probe GET {probe_url} → {status} {body[:200]!r}"
                return
            url = s.url(ports["http"])
            run(row, s.wrk(url, variant_headers), parse_wrk, p.pid)
            if h2row is not None:  # the same gateway over h2c: as many requests in flight
                cmd, parse = h2c(f"h2-{len(rows)}", url, variant_headers)
                run(h2row, cmd, parse, p.pid)

        return go

    variants = [
        Variant(engine, chain, tracing)
        for engine in engines
        for chain in chains
        for tracing in tracings
    ]
    if s.args.full:
        variants += [Variant(engine, full=True) for engine in engines]
    for v in variants:
        row = Row(f"HTTP Sluice {v.label}")
        h2row = Row(f"HTTP/2 Sluice {v.label}") if h2 and v.engine == "native" else None
        rows.append(gateway_row(s, row, v, (http_be, None), probe(row, h2row, v)))
        if h2row is not None:
            rows.append(h2row)
    rounds = getattr(s.args, "rounds", 0)  # tests build partial args
    if rounds > 0:
        from gateway.bench.rounds import round_ratios

        def measure_round(row: Row, cmd: MakeCmd, parse: Parse, pid: int) -> Row:
            return run(row, cmd, parse, pid, None, s.args.pair_duration)

        round_ratios(s, http_be, variants, rounds, measure_round, h2c if h2 else None)
    if s.args.full and not s.args.no_leave_one_out and s.args.pairs > 0:
        from gateway.bench.features import feature_costs

        def measure_for(row: Row, cmd: MakeCmd, pid: int) -> Row:
            return run(row, cmd, parse_wrk, pid, None, s.args.pair_duration)

        floor_us = next(
            (r.cpu_us_per_req for r in rows if r.name.startswith("HTTP floor") and not r.error),
            None,
        )
        feature_costs(s, engines[0], http_be, measure_for, floor_us)
    if s.args.auth:
        from gateway.bench.auth import auth_rows

        rows += auth_rows(s, http_be, Variant(engines[0]), run)
    return rows


def _models(port: int) -> str:
    return f"http://127.0.0.1:{port}/v1/models"
