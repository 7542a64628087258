"""Load generators of `sluice bench`: wrk, h2load and the grpc.aio fallback client.

Each builder returns `duration → command line` (pinned to the load cores) and, for gRPC, the parser
of that command's output; parsers fill a `Row`. grpc is imported inside the functions that use it.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.bench.procs import pinned
from gateway.bench.report import Row

INFER = "/sluice.inference.v1.Inference/Infer"

MakeCmd = Callable[[int], list[str]]  # duration in seconds → command line
Parse = Callable[[str, Row], None]  # the command's stdout → figures in the row

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def run_load(cmd: list[str], duration: int) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def percentile_ms(durations_us: list[int], pct: float) -> float | None:
    if not durations_us:
        return None
    s = sorted(durations_us)
    return s[min(len(s) - 1, max(0, round(pct / 100 * len(s)) - 1))] / 1000


# ---------------------------------------------------------------------------- wrk (HTTP)

# The HTTP rows' request (`--method post`, the default): an OpenAI-style chat completion POST of
# ~200 B to /v1/chat/completions; `--method get`: GET /v1/models.
CHAT_BODY = (
    '{"model": "llama-3-8b", "max_tokens": 16, "stream": false, "messages": '
    '[{"role": "system", "content": "You are terse."}, '
    '{"role": "user", "content": "Say hello to the gateway in five words."}]}'
)
CHAT_PATH = "/v1/chat/completions"


def post_script(tmp: Path) -> Path:
    """A wrk Lua script sending the chat POST (other headers may be added with `-H`)."""
    path = tmp / "post.lua"
    if not path.exists():
        path.write_text(
            'wrk.method = "POST"\n'
            f"wrk.body = '{CHAT_BODY}'\n"
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
    return path


def wrk_cmd(load_cpus: str, connections: int, url: str, extra: Sequence[str] = ()) -> MakeCmd:
    """A function: duration → the wrk command line, pinned to the load cores (`extra`: more
    wrk arguments, e.g. `-H` or `-s script.lua`)."""

    def make(duration: int) -> list[str]:
        cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", *extra, url]
        return pinned(load_cpus, cmd)

    return make


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"unparsable wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_wrk(out: str, row: Row) -> None:
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    total = re.search(r"^\s*(\d+) requests in", out, re.M)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    if not (rps and total and p50 and p99):
        raise RuntimeError(f"could not parse wrk output:\n{out}")
    row.rps, row.requests = float(rps.group(1)), int(total.group(1))
    row.p50_ms, row.p99_ms = _ms(p50.group(1)), _ms(p99.group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    row.failed = (int(non2xx.group(1)) if non2xx else 0) + (
        sum(int(x) for x in sock.groups()) if sock else 0
    )


# ---------------------------------------------------------------------------- gRPC


def grpc_load(
    tmp: Path, load_cpus: str, connections: int, streams: int, name: str, port: int
) -> tuple[MakeCmd, Parse]:
    """(duration → command line, parser) for the gRPC load: h2load, else the grpc.aio client."""
    c, m = str(connections), str(streams)
    if shutil.which("h2load") is None:

        def aio(duration: int) -> list[str]:
            code = (
                "import sys; from gateway.bench.loads import aio_load_main as f; "
                "sys.exit(f(sys.argv[1:]))"
            )
            cmd = [sys.executable, "-c", code, f"127.0.0.1:{port}", str(duration), c, m]
            return pinned(load_cpus, cmd)

        return aio, parse_aio
    body = tmp / "infer.grpc"
    if not body.exists():
        body.write_bytes(grpc_body())
    log_file = tmp / f"{name}.h2load.tsv"

    def h2load(duration: int) -> list[str]:
        cmd = ["h2load", "-t1", "-c", c, "-m", m, "-D", str(duration), "-d", str(body)]
        cmd += ["-H", "content-type: application/grpc", "-H", "te: trailers"]
        cmd += ["--log-file", str(log_file), f"http://127.0.0.1:{port}{INFER}"]
        return pinned(load_cpus, cmd)

    return h2load, lambda out, row: parse_h2load(out, log_file, row)


def h2c_load(
    tmp: Path,
    load_cpus: str,
    connections: int,
    streams: int,
    name: str,
    url: str,
    body: Path | None = None,
    headers: Sequence[str] = (),
) -> tuple[MakeCmd, Parse]:
    """(duration → command line, parser) for HTTP/2 (h2c with prior knowledge) requests of
    `url`: h2load, `connections` × `streams` in flight; a JSON POST of `body` if given, else GET;
    `headers` as wrk's (`-H`, "Name: value" pairs)."""
    log_file = tmp / f"{name}.h2load.tsv"

    def h2load(duration: int) -> list[str]:
        cmd = ["h2load", "-t1", "-c", str(connections), "-m", str(streams), "-D", str(duration)]
        if body is not None:
            cmd += ["-d", str(body), "-H", "content-type: application/json"]
        cmd += list(headers)
        cmd += ["--log-file", str(log_file), url]
        return pinned(load_cpus, cmd)

    return h2load, lambda out, row: parse_h2load(out, log_file, row)


def parse_h2load(out: str, log_file: Path, row: Row) -> None:
    rps = re.search(r"^finished in [\d.]+\w+, ([\d.]+) req/s", out, re.M)
    req = re.search(
        r"^requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, "
        r"(\d+) errored, (\d+) timeout",
        out,
        re.M,
    )
    codes = re.search(r"^status codes: (\d+) 2xx", out, re.M)
    if not (rps and req and codes):
        raise RuntimeError(f"could not parse h2load output:\n{out}")
    row.rps, row.requests = float(rps.group(1)), int(req.group(1))
    row.failed = int(req.group(3)) + int(req.group(4)) + int(req.group(5))
    row.failed += max(0, int(req.group(2)) - int(codes.group(1)))
    durations = []
    for line in log_file.read_text().splitlines():
        cols = line.split("\t")
        if len(cols) >= 3 and cols[1] == "200":
            durations.append(int(cols[2]))
    row.p50_ms, row.p99_ms = percentile_ms(durations, 50), percentile_ms(durations, 99)


def grpc_body() -> bytes:
    """One gRPC-framed (uncompressed, length-prefixed) InferRequest, as h2load sends it."""
    from gateway.proto import load

    pb2, _ = load()
    msg: bytes = pb2.InferRequest(model="m", prompt="hello", max_tokens=1).SerializeToString()
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


async def _grpc_probe(target: str) -> str:
    """One unary Infer through grpc.aio; returns the status code name (OK expected)."""
    import grpc

    from gateway.proto import load

    pb2, pb2_grpc = load()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb2_grpc.InferenceStub(channel)
        call = stub.Infer(pb2.InferRequest(model="m", prompt="hello", max_tokens=1), timeout=2)
        try:
            await call
        except grpc.aio.AioRpcError as e:
            return str(e.code().name)
        code = await call.code()
        return str(code.name)


def grpc_ok(target: str) -> bool:
    code = asyncio.run(_grpc_probe(target))
    if code != "OK":
        raise RuntimeError(f"grpc-status {code} from {target}")
    return True


async def _aio_load(target: str, duration: float, conns: int, streams: int) -> dict[str, Any]:
    import grpc

    body = grpc_body()[5:]
    method = INFER
    durations: list[int] = []
    failed = 0
    stop = time.monotonic() + duration
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(conns)
    ]

    async def worker(ch: grpc.aio.Channel) -> None:
        nonlocal failed
        call = ch.unary_unary(method, None, None)  # bytes in, bytes out
        while time.monotonic() < stop:
            t0 = time.perf_counter_ns()
            try:
                await call(body, timeout=10)
                durations.append((time.perf_counter_ns() - t0) // 1000)
            except grpc.aio.AioRpcError:
                failed += 1

    t0 = time.monotonic()
    await asyncio.gather(*(worker(ch) for ch in channels for _ in range(streams)))
    elapsed = time.monotonic() - t0
    for ch in channels:
        await ch.close(None)
    return {"requests": len(durations), "failed": failed, "elapsed": elapsed, "us": durations}


def aio_load_main(argv: Sequence[str]) -> int:
    """Fallback gRPC load client (no h2load): TARGET DURATION CONNS STREAMS → JSON on stdout."""
    target, duration, conns, streams = argv[0], float(argv[1]), int(argv[2]), int(argv[3])
    r = asyncio.run(_aio_load(target, duration, conns, streams))
    us = r.pop("us")
    r["rps"] = r["requests"] / r["elapsed"] if r["elapsed"] else 0.0
    r["p50_ms"], r["p99_ms"] = percentile_ms(us, 50), percentile_ms(us, 99)
    print(json.dumps(r))
    return 0


def parse_aio(out: str, row: Row) -> None:
    r = json.loads(out.strip().splitlines()[-1])
    row.rps, row.requests, row.failed = r["rps"], r["requests"], r["failed"]
    row.p50_ms, row.p99_ms = r["p50_ms"], r["p99_ms"]
