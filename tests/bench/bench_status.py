"""Benchmark of the status page (not part of the test run; needs chromium and playwright).

    .venv/bin/python tests/bench/bench_status.py [--refreshes 300] [--loads 5]

Starts a simulated backend and a gateway on free ports (two backends, one route each), then:
1. the page's load time in headless Chromium: navigation to the first rendered colour, the
   median of `--loads` fresh page loads;
2. the refresh cost on the admin listener: `--refreshes` GET /admin/state one after the other,
   wall time per answer and the gateway process's CPU time per answer (utime + stime from
   /proc), and the document's size: what one open page costs the gateway every 2 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.conftest import Backend, start_gateway  # noqa: E402
from tests.status.browser import chromium  # noqa: E402
from tests.support import Proc, free_port, wait_for_port  # noqa: E402


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--refreshes", type=int, default=300)
    ap.add_argument("--loads", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-status-"))
    h, g, a = free_port(), free_port(), free_port()
    mock = Proc(["mock-backend", "--http", f"127.0.0.1:{h}", "--grpc", f"127.0.0.1:{g}",
                 "--admin", f"127.0.0.1:{a}"], tmp / "backend.log")  # fmt: skip
    try:
        wait_for_port(h)
        wait_for_port(g)
        gw = start_gateway(Backend(mock, h, g, a), tmp)
        try:
            url = f"{gw.admin}/admin/state"
            with urllib.request.urlopen(url, timeout=5) as r:
                size = len(r.read())
            pid = gw.proc.popen.pid
            c0, t0 = cpu_s(pid), time.perf_counter()
            for _ in range(args.refreshes):
                with urllib.request.urlopen(url, timeout=5) as r:
                    r.read()
            wall, cpu = time.perf_counter() - t0, cpu_s(pid) - c0
            loads = []
            with chromium() as browser:
                for _ in range(args.loads):
                    page = browser.new_page()
                    t = time.perf_counter()
                    page.goto(f"{gw.admin}/status")
                    page.wait_for_selector("#banner:not([data-colour=grey])", timeout=15_000)
                    loads.append(time.perf_counter() - t)
                    page.close()
            n = args.refreshes
            per_wall, per_cpu = wall / n * 1e3, cpu / n * 1e3
            print(f"/admin/state: {size} bytes; {per_wall:.2f} ms per answer (wall), ")
            print(f"  {per_cpu:.2f} ms gateway CPU per answer over {n} answers")
            med, lo, hi = (x * 1e3 for x in (statistics.median(loads), min(loads), max(loads)))
            print(f"/status first render: median {med:.0f} ms (min {lo:.0f}, max {hi:.0f})")
        finally:
            gw.proc.stop()
    finally:
        mock.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
