"""What scraping the model servers' figures costs (`load.metrics`), measured (by hand; not part
of `make test`):

    .venv/bin/python tests/bench/bench_scrape.py [--members 100] [--interval-ms 100]
        [--seconds 10] [--page mock|vllm] [--engines 1] [--loop uvloop|asyncio]

A separate process serves a metrics page on `--members` loopback ports (raw asyncio, keep-alive;
`mock`: the simulated backend's own page, ~0.9 KB; `vllm`: the three gauges among ten
histograms per engine, ~25 KB per engine, `--engines N`). This process runs the gateway's scraper
(`gateway.registry.scrape`, through a backend pool as the gateway does) on all of them and
reports its own CPU time (`time.process_time`) over `--seconds`: CPU per scrape, and the share of
one core. The scan alone (`gateway.core.serverload.scan` on the page) is timed too.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.core.serverload import scan, wanted  # noqa: E402
from gateway.mockbackend.knobs import Knobs, MockState  # noqa: E402
from gateway.policy.model import Backend  # noqa: E402
from gateway.registry.pool import BACKENDS, BackendPool  # noqa: E402
from gateway.services import Services  # noqa: E402


def mock_page() -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.mockbackend.vllm_metrics import VllmGauges

    reg = CollectorRegistry()
    state = MockState(Knobs(slots=8))
    state.stats.generating = 5
    reg.register(VllmGauges(state, "mock-model"))
    return generate_latest(reg)


def vllm_page(engines: int) -> bytes:
    """The three gauges among the histograms a vLLM page carries (~25 KB per engine)."""
    lines = [mock_page().decode()]
    buckets = [
        "0.001",
        "0.005",
        "0.01",
        "0.02",
        "0.04",
        "0.06",
        "0.08",
        "0.1",
        "0.25",
        "0.5",
        "0.75",
        "1",
        "2.5",
        "5",
        "7.5",
        "10",
        "20",
        "40",
        "80",
        "+Inf",
    ]
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_inference_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "iteration_tokens_total"):  # fmt: skip
        lines.append(f"# HELP vllm:{name} Histogram.\n# TYPE vllm:{name} histogram\n")
        for engine in range(engines):
            lab = f'engine="{engine}",model_name="meta-llama/Llama-3.1-8B-Instruct"'
            for b in buckets:
                lines.append(f'vllm:{name}_bucket{{{lab},le="{b}"}} 12345.0\n')
            lines.append(f"vllm:{name}_count{{{lab}}} 12345.0\nvllm:{name}_sum{{{lab}}} 678.9\n")
    return "".join(lines).encode()


async def serve(ports: list[int], page: bytes) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (
        len(page), page,
    )  # fmt: skip

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while await r.readuntil(b"\r\n\r\n"):
                w.write(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    servers = [await asyncio.start_server(handle, "127.0.0.1", p) for p in ports]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def free_ports(n: int) -> list[int]:
    import socket

    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


async def scrape(ports: list[int], interval_ms: int, seconds: float) -> tuple[int, int, float]:
    services = Services()
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    cfg = Backend.model_validate({
        "name": "bench", "endpoints": [{"address": f"127.0.0.1:{p}"} for p in ports],
        "load": {"metrics": {"interval_ms": interval_ms}},
    })  # fmt: skip
    v = pool.view(cfg)
    pool.activate([v], {})
    members = list(v.members.values())

    def counts() -> tuple[int, int]:
        recs = [m.core.scrape for m in members if m.core.scrape is not None]
        return sum(r.ok for r in recs), sum(r.failed for r in recs)

    await asyncio.sleep(2.0)  # every member connected and staggered
    ok0, failed0 = counts()
    cpu0, wall0 = time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    ok, failed = counts()
    await services.aclose()
    return ok - ok0, failed - failed0, cpu / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--members", type=int, default=100)
    ap.add_argument("--interval-ms", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--page", choices=["mock", "vllm"], default="vllm")
    ap.add_argument("--engines", type=int, default=1, help="vllm page: engines (data parallel)")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # the page server's own process
    a = ap.parse_args()
    page = mock_page() if a.page == "mock" else vllm_page(a.engines)
    if a.serve:
        asyncio.run(serve([int(p) for p in a.serve.split(",")], page))
        return
    want = wanted("vllm", {})
    f = scan(page, want, 0.0)
    assert not f.missing, f.missing
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        scan(page, want, 0.0)
    scan_us = (time.perf_counter() - t0) / n * 1e6
    ports = free_ports(a.members)
    server = subprocess.Popen(
        [sys.executable, __file__, "--page", a.page, "--engines", str(a.engines), "--serve",
         ",".join(map(str, ports))],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        if a.loop == "uvloop":  # as `sluice serve` runs
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                ok, failed, share = runner.run(scrape(ports, a.interval_ms, a.seconds))
        else:
            ok, failed, share = asyncio.run(scrape(ports, a.interval_ms, a.seconds))
    finally:
        server.terminate()
        server.wait()
    expected = a.members * a.seconds * 1000 / a.interval_ms
    per = share * a.seconds / max(ok, 1) * 1e6
    print(f"page: {a.page}, {len(page)} bytes; scan alone: {scan_us:.1f} µs; loop: {a.loop}")
    print(f"{a.members} members @ {a.interval_ms} ms for {a.seconds:g} s: {ok} scrapes "
          f"({ok / expected:.0%} of {expected:.0f}), {failed} failed")  # fmt: skip
    print(f"CPU per scrape: {per:.0f} µs; share of one core: {share:.1%}")


if __name__ == "__main__":
    main()
