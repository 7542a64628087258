"""Where the gateway's CPU goes per request: `python -m tests.bench.profile_hot_path [options]`.

    python -m tests.bench.profile_hot_path [--duration 10] [--engine native|aiohttp]
        [--policy-extra sections.yaml] [--filters a,b,c] [--full [--without FEATURE]] [--top 25]
        [--rate 250] [--get]
        [--native] [--h2c [--h2-connections 4] | --close]

Starts an nginx backend (serving `/v1/models` and `/v1/chat/completions` itself) on the load
core, `sluice serve` with the bench policy (`gateway.bench`: the same policy, `--filters`,
`--policy-extra` and `--full` as `sluice bench`) on the gateway core, drives it with wrk (32
connections, the bench's ~200 B OpenAI-style chat POST, or `--get`), and samples the gateway
process with py-spy (`py-spy record --format raw`, `--rate` samples per second,
`--nonblocking`) for `--duration` seconds. Prints the functions with the most samples of their
own (self), with the most samples under them (inclusive), and the packages with the most samples
of their own (h2, hpack, asyncio, Sluice's subpackages), as shares of all samples, and the
gateway CPU µs per request of the same run (sampling adds a few per cent). The raw stacks are
kept (`--keep FILE`) for a flame graph (`flamegraph.pl`, speedscope). The compiled request path
(`gateway.native`) has no Python frames: its time is charged to the interpreted frame that
called it, unless `--native` asks py-spy for C frames too (it then stops the process for each
sample, which slows it: read shares, not the CPU figure). `--h2c`: the same gateway driven over
HTTP/2 (h2c, prior knowledge) by h2load with `sluice bench`'s HTTP/2 command (`--connections`
requests in flight as streams over `--h2-connections` connections), the native engine's h2c path.
`--close`: HTTP/1.1 with a connection per request (wrk with `Connection: close`): accepting,
the request, the answer and the close.

`--callgrind` counts instead of sampling: the gateway runs under valgrind's callgrind, its
counters are zeroed after the warm-up and dumped after `--duration` seconds of load, and the
instructions per request are printed, all threads' and the event loop's thread's alone (the
other threads' periodic work, as the span exporter's, weighs ~50× more a request under valgrind
and moves from run to run: compare the loop's), with the loop's dump's path
(`callgrind_annotate --inclusive=yes FILE` for the functions), and the compiled functions that
read attributes by name most (a generic lookup, ~175 instructions, where a compiled class's
field is one load). Instructions do
not move with the machine's load as CPU time does, so two gateways (the default and the full
chain, two engines, before and after a change) compare even on a noisy machine; valgrind runs
the gateway ~50 times slower and hides the CPU's SHA and AES instructions from OpenSSL, so read
its hashing as dearer than it is.

Needs py-spy (`pip install py-spy`, in the dev extras), nginx and wrk (h2load for `--h2c`), as
`sluice bench` does; valgrind for `--callgrind`.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.bench.full import FEATURES
from gateway.bench.gateways import Setup, Variant, parse_chains, start_gateway
from gateway.bench.loads import parse_wrk
from gateway.bench.procs import Procs, cpu_seconds, pinned, start_nginx
from gateway.bench.report import Row


def fold(raw: str) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    """py-spy's raw output (`frame;frame;...;leaf COUNT` per line) → samples per function as the
    leaf (self), samples per function anywhere in the stack (inclusive), all samples."""
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + _where(f) for f in stack.split(";") if f]
        if frames:
            own[frames[-1]] += n
        for f in set(frames):
            under[f] += n
    return own, under, total


def by_package(raw: str) -> tuple[collections.Counter[str], int]:
    """py-spy's raw output → self samples per package of the leaf frame (`h2`, `hpack`,
    `asyncio`, …; Sluice's by subpackage: `gateway/forward`, `gateway/adapters/h2`), all samples.
    """
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        leaf = stack.rsplit(";", 1)[-1]
        path = leaf.partition(" (")[2].rstrip(")").rsplit(":", 1)[0]
        parts = path.split("/")
        depth = 3 if parts[:2] == ["gateway", "adapters"] else 2 if parts[0] == "gateway" else 1
        own["/".join(parts[: min(depth, len(parts) - 1)]) or path or "?"] += int(count)
    return own, total


def _where(frame: str) -> str:
    """` (file.py)` of a py-spy frame `func (path/file.py:line)`, without the line."""
    _, _, rest = frame.partition(" (")
    path = rest.rstrip(")").rsplit(":", 1)[0]
    return f" ({'/'.join(path.split('/')[-2:])})" if path else ""


def report(own: collections.Counter[str], under: collections.Counter[str], total: int, top: int):
    lines = [f"{total} samples"]
    for title, counter in (("self", own), ("inclusive", under)):
        lines.append(f"\n{title}:")
        for name, n in counter.most_common(top):
            lines.append(f"  {100 * n / max(total, 1):5.1f} %  {name}")
    return "\n".join(lines)


def count_instructions(
    a: argparse.Namespace, pid: int, make: Any, parse: Any, row: Row, dump: Path
) -> int:
    """The gateway's instructions per request over `a.duration` s of load (callgrind)."""
    subprocess.run(["callgrind_control", "-z", str(pid)], capture_output=True, check=True)
    out = subprocess.run(
        make(a.duration), capture_output=True, text=True, timeout=a.duration + 60
    ).stdout
    subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, check=True)
    parse(out, row)
    # Threads are dumped apart (`--separate-threads=yes`): FILE.N-TT, N the dump, TT the
    # thread (01 the main one, where the event loop runs). The newest N is the dump after the
    # zeroing; each file's `summary:` line is its thread's total.
    threads = dump_threads(dump)
    if not threads or not row.requests:
        print(f"no dump or no requests ({threads}, {row.requests})", file=sys.stderr)
        return 1
    totals = {tt: summary_of(f) for tt, f in threads.items()}
    total, loop = sum(totals.values()), totals.get("01", 0)
    chain_name = "full" if a.full else a.filters or "default"
    how = "h2c" if a.h2c else "HTTP/1.1, a connection per request" if a.close else "HTTP/1.1"
    print(f"{a.engine} engine, chain {chain_name}, {how}: "
          f"{row.requests} requests, {total / row.requests / 1000:.1f} k instructions per "
          f"request; the event loop's thread {loop / row.requests / 1000:.1f} k (the other "
          f"threads' periodic work weighs ~50x under valgrind)\n"
          f"callgrind_annotate --inclusive=yes {threads.get('01')}")  # fmt: skip
    main = threads.get("01")
    lookups = generic_lookups(main, row.requests) if main is not None else []
    if lookups:
        print(f"reads by name per request: {sum(n for n, _ in lookups):.0f}; the callers that "
              "make most (compiled functions by their C names; interpreted code, as h2's, shows "
              "as _PyEval_EvalFrameDefault and _PyObject_GetMethod):")  # fmt: skip
        for n, fn in lookups[: a.top]:
            print(f"  {n:5.1f}  {fn}")
    return 0


def dump_threads(dump: Path) -> dict[str, Path]:
    """The newest dump's file of each thread, by thread number ("01", "02", ...), from the
    files `--separate-threads=yes` writes (FILE.N-TT)."""
    found: dict[int, dict[str, Path]] = {}
    for f in dump.parent.glob(f"{dump.name}.*-*"):
        n, _, tt = f.name[len(dump.name) + 1 :].partition("-")
        if n.isdigit() and tt.isdigit():
            found.setdefault(int(n), {})[tt] = f
    return found[max(found)] if found else {}


def summary_of(part: Path) -> int:
    """A dump file's total (its `summary:` or `totals:` line)."""
    for line in part.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    return 0


_CALLER = re.compile(r"^\s*[\d,]+ \([ \d.]+%\)\s+<\s+(\S+:)?(\S+?)(?:'\d+)? \(([\d,]+)x\)")


def generic_lookups(dump: Path, requests: int) -> list[tuple[float, str]]:
    """The callers of `PyObject_GetAttr` (an attribute read by name: on an interpreted object,
    or a compiled one seen through a Protocol), per request, most first, from
    `callgrind_annotate --tree=caller`. A compiled function reading a compiled class's field
    makes none."""
    try:
        tree = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", "--tree=caller", str(dump)],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return lookups_in(tree, requests)


def lookups_in(tree: list[str], requests: int) -> list[tuple[float, str]]:
    """`generic_lookups` from the lines of `callgrind_annotate --tree=caller`."""
    block: list[str] = []
    for line in tree:
        if not line.strip():
            block = []
        elif re.search(r"\*\s+\S*Objects/object\.c:PyObject_GetAttr( |$)", line):
            break
        else:
            block.append(line)
    else:
        return []
    calls: dict[str, int] = {}
    for line in block:
        m = _CALLER.match(line)
        if m:
            fn = m.group(2).removeprefix("CPyDef_")
            calls[fn] = calls.get(fn, 0) + int(m.group(3).replace(",", ""))
    return sorted(((n / requests, fn) for fn, n in calls.items()), reverse=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.profile_hot_path")
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--engine", choices=("native", "aiohttp"), default="native")
    ap.add_argument("--filters", default=None, help="a,b,c (default: the policy's chain)")
    ap.add_argument("--policy-extra", default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--rate", type=int, default=250)
    ap.add_argument("--get", action="store_true", help="GET /v1/models instead of the POST")
    ap.add_argument("--full", action="store_true", help="the full chain (gateway.bench.full)")
    ap.add_argument(
        "--without",
        choices=FEATURES,
        default=None,
        help="with --full: the full chain minus this feature (sluice bench's pairs)",
    )
    ap.add_argument(
        "--keep", default=None, help="write py-spy's raw stacks here (--callgrind: its dumps)"
    )
    ap.add_argument(
        "--native",
        action="store_true",
        help="sample C frames too (py-spy --native): the compiled request path's functions",
    )
    ap.add_argument("--gateway-cpus", default="0")
    ap.add_argument("--load-cpus", default="1")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--h2c", action="store_true", help="HTTP/2 (h2c) with h2load instead of wrk")
    ap.add_argument("--close", action="store_true", help="a connection per request (HTTP/1.1)")
    ap.add_argument("--h2-connections", type=int, default=4, help="h2load -c with --h2c")
    ap.add_argument(
        "--callgrind", action="store_true", help="instructions per request (valgrind's callgrind)"
    )
    a = ap.parse_args(argv)
    a.no_access_log = False
    a.method = "get" if a.get else "post"
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not a.callgrind and not Path(spy).exists():
        print("py-spy not found: pip install py-spy", file=sys.stderr)
        return 2
    for tool in ("nginx", "h2load" if a.h2c else "wrk", *(("valgrind",) if a.callgrind else ())):
        if shutil.which(tool) is None:
            print(f"{tool} not found", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="sluice-profile-") as d:
        tmp = Path(d)
        procs = Procs(tmp)
        s = Setup(a, procs)
        try:
            backend = start_nginx(procs, "nginx-backend", s.load_cpus, None)[1]
            chain = parse_chains([a.filters] if a.filters else None)[0]
            variant = Variant(a.engine, chain, full=a.full, without=a.without)
            under: list[str] = []
            if a.callgrind:  # the dumps outlive the run: `--keep`, or a directory of their own
                where = a.keep or Path(tempfile.mkdtemp(prefix="sluice-callgrind-")) / "out"
                dump = Path(where).resolve()
                under = ["valgrind", "--tool=callgrind", "--separate-threads=yes"]
                under += [f"--callgrind-out-file={dump}"]
            gw, ports = start_gateway(s, backend, None, variant, "sluice", under=under)
            url = s.url(ports["http"])
            row = Row("Sluice")
            if a.h2c:
                streams = max(1, a.connections // a.h2_connections)
                make, parse = s.h2load("h2", url, s.headers(variant), a.h2_connections, streams)
            else:
                close = ["-H", "Connection: close"] if a.close else []
                make, parse = s.wrk(url, [*s.headers(variant), *close]), parse_wrk
            subprocess.run(make(2), capture_output=True, timeout=30, check=False)  # warm up
            if a.callgrind:
                return count_instructions(a, gw.pid, make, parse, row, dump)
            raw = tmp / "stacks.txt"
            spy_cmd = [spy, "record", "--pid", str(gw.pid), "--duration", str(a.duration)]
            spy_cmd += ["--rate", str(a.rate), "--format", "raw"]
            # --native stops the process for each sample (py-spy reads C stacks only so).
            spy_cmd += ["--native"] if a.native else ["--nonblocking"]
            spy_cmd += ["--output", str(raw)]
            sampler = subprocess.Popen(pinned(s.load_cpus, spy_cmd), stdout=subprocess.DEVNULL)
            cpu0 = cpu_seconds(gw.pid)
            out = subprocess.run(
                make(a.duration), capture_output=True, text=True, timeout=a.duration + 30
            ).stdout
            cpu1 = cpu_seconds(gw.pid)
            sampler.wait(a.duration + 30)
            parse(out, row)
            text = raw.read_text() if raw.exists() else ""
            if a.keep:
                Path(a.keep).write_text(text)
            own, under, total = fold(text)
            what = "GET /v1/models" if a.get else "POST (JSON, ~200 B)"
            chain_name = "full" if a.full else a.filters or "default"
            over = f", h2c ({a.h2_connections} connections)" if a.h2c else ""
            over += ", a connection per request" if a.close else ""
            print(f"{a.engine} engine, chain {chain_name}, {what}{over}")
            if row.requests:
                print(f"{row.requests / a.duration:,.0f} req/s, gateway CPU (sampled) "
                      f"{(cpu1 - cpu0) * 1e6 / row.requests:.1f} µs/request")  # fmt: skip
            print(report(own, under, total, a.top))
            packages, _ = by_package(text)
            print("\nself, by package:")
            for name, n in packages.most_common(a.top):
                print(f"  {100 * n / max(total, 1):5.1f} %  {name}")
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
