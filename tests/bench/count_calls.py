"""Function calls per request in the gateway: `python -m tests.bench.count_calls [options]`.

    python -m tests.bench.count_calls [--seconds 4] [--engine native|aiohttp] [--full] [--get]
        [--top 40] [--by-caller] [--h2c | --grpc | --close]

A count, not a time: the same on every run, so it shows what a small change to the hot path
takes away where the CPU figures of `sluice bench` move by more than that from run to run.
Starts an nginx backend, then `sluice serve` with the bench policy (`gateway.bench`: the same
policy, `--full` as `sluice bench --full`) inside a child of this module that counts, while
told to (SIGUSR1 on, SIGUSR2 off and write the counts), every Python function call of the
event-loop thread (`sys.setprofile`: a call event, and another each time a coroutine resumes)
and every call into C (`len`, `list.append`, a socket write); drives it with wrk (8
connections, the bench's chat POST, or `--get`) and prints the calls per request and the
functions called most. `--by-caller` names each call by the line that makes it. The counting
makes the gateway several times slower: read the counts, not its speed. `--h2c`: the same
gateway driven over HTTP/2 (h2c, prior knowledge) by h2load, 8 streams in flight over 2
connections, the native engine's HTTP/2 path. `--grpc`: gRPC unary calls on the h2 engine (the
simulated backend's `Infer` with `sluice bench`'s gRPC load: h2load, 8 calls in flight over 2
connections); the counts are per call. `--close`: HTTP/1.1 with a connection per request (wrk
with `Connection: close`), what a client that does not keep its connection costs: accepting,
the request, the answer and the close.

Needs nginx and wrk (h2load for `--h2c` and `--grpc`), as `sluice bench` does.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from gateway.bench.gateways import Setup, Variant, start_gateway, start_mock
from gateway.bench.loads import parse_wrk
from gateway.bench.procs import Procs, start_nginx, wait_until
from gateway.bench.report import Row


def child(argv: list[str]) -> int:
    """`sluice` with `argv`, counting calls between SIGUSR1 and SIGUSR2 (written to the file
    named by SLUICE_COUNT_CALLS, one `count<TAB>where<TAB>name` line each)."""
    from gateway.cli import main

    out = Path(os.environ["SLUICE_COUNT_CALLS"])
    by_caller = os.environ.get("SLUICE_COUNT_BY_CALLER") == "1"
    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def where(code: Any, line: int = 0) -> str:
        name = code.co_filename.rsplit("/gateway/", 1)[-1].rsplit("/", 1)[-1]
        return f"{name}:{line or code.co_firstlineno}"

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_name
            back = frame.f_back
            if by_caller and back is not None:
                name += " <- " + where(back.f_code, back.f_lineno)
            counts[(where(frame.f_code), name)] += 1
        elif event == "c_call":
            caller = "C@" + where(frame.f_code, frame.f_lineno) if by_caller else "C@"
            counts[(caller, getattr(arg, "__qualname__", repr(arg)))] += 1

    def start(*_: object) -> None:
        counts.clear()
        sys.setprofile(profile)

    def stop(*_: object) -> None:
        sys.setprofile(None)
        lines = [f"{n}\t{w}\t{name}" for (w, name), n in counts.most_common()]
        out.write_text("\n".join(lines) + "\n")

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    return main(argv)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        return child(args[1:])
    ap = argparse.ArgumentParser(prog="python -m tests.bench.count_calls")
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--engine", choices=("native", "aiohttp"), default="native")
    ap.add_argument("--full", action="store_true", help="the full chain (gateway.bench.full)")
    ap.add_argument("--get", action="store_true", help="GET /v1/models instead of the POST")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--by-caller", action="store_true")
    ap.add_argument("--h2c", action="store_true", help="HTTP/2 (h2c) with h2load instead of wrk")
    ap.add_argument("--grpc", action="store_true", help="gRPC unary calls on the h2 engine")
    ap.add_argument("--close", action="store_true", help="a connection per request (HTTP/1.1)")
    a = ap.parse_args(args)
    a.gateway_cpus, a.load_cpus, a.connections = "0", "1", 8
    a.grpc_connections, a.grpc_streams = 2, 8
    a.method, a.no_access_log, a.policy_extra = ("get" if a.get else "post"), False, None
    with tempfile.TemporaryDirectory(prefix="sluice-calls-") as d:
        tmp = Path(d)
        procs = Procs(tmp)
        s = Setup(a, procs)
        try:
            counts = tmp / "counts.txt"
            os.environ["SLUICE_COUNT_CALLS"] = str(counts)
            os.environ["SLUICE_COUNT_BY_CALLER"] = "1" if a.by_caller else "0"
            runner = ("-m", "tests.bench.count_calls", "--child")
            if a.grpc:  # the mock backend's unary Infer, as `sluice bench`'s gRPC rows
                grpc_backend = start_mock(s)[1]
                variant = Variant(None, None, grpc_engine="h2", full=a.full)
                gw, ports = start_gateway(s, None, grpc_backend, variant, "sluice", runner=runner)
                make, parse = s.grpc("grpc", ports["grpc"])
            else:
                backend = start_nginx(procs, "nginx-backend", s.load_cpus, None)[1]
                variant = Variant(a.engine, None, full=a.full)
                gw, ports = start_gateway(s, backend, None, variant, "sluice", runner=runner)
                url = s.url(ports["http"])
                if a.h2c:
                    make, parse = s.h2load("h2", url, s.headers(variant), 2, 4)
                else:
                    close = ["-H", "Connection: close"] if a.close else []
                    make, parse = s.wrk(url, [*s.headers(variant), *close]), parse_wrk
            subprocess.run(make(2), capture_output=True, timeout=30, check=False)  # warm up
            os.kill(gw.pid, signal.SIGUSR1)
            time.sleep(0.2)
            out = subprocess.run(
                make(a.seconds), capture_output=True, text=True, timeout=a.seconds + 30
            ).stdout
            time.sleep(0.5)  # the last answers and their bookkeeping
            os.kill(gw.pid, signal.SIGUSR2)
            wait_until("the counts", counts.exists, [gw])
            row = Row("Sluice")
            parse(out, row)
            print(report(counts.read_text(), row.requests, a))
        finally:
            procs.stop_all()
    return 0


def report(text: str, requests: int, a: argparse.Namespace) -> str:
    rows = [line.split("\t") for line in text.splitlines() if line]
    n = max(requests, 1)
    python = sum(int(c) for c, w, _ in rows if not w.startswith("C@"))
    c_calls = sum(int(c) for c, w, _ in rows if w.startswith("C@"))
    what = "GET /v1/models" if a.get else "POST (JSON, ~200 B)"
    what += ", h2c" if a.h2c else ", a connection per request" if a.close else ""
    engine, unit = a.engine, "request"
    if a.grpc:
        engine, what, unit = "h2", "gRPC unary Infer", "call"
    lines = [
        f"{engine} engine, chain {'full' if a.full else 'default'}, {what}: {requests} {unit}s",
        f"per {unit}: {python / n:.1f} Python calls (and coroutine resumes), "
        f"{c_calls / n:.1f} calls into C",
    ]
    for c, w, name in rows[: a.top]:
        lines.append(f"  {int(c) / n:7.2f}  {name:32s} {w.removeprefix('C@') or 'C'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
