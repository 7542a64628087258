"""Processes of `sluice bench`: start, pin, stop, wait until ready, and read their CPU from /proc.

Also the nginx configuration (backend and reference proxy) and the core checks made before a run
(pinning available, machine idle). Every wait has a deadline; `Procs.stop_all` ends every child.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from gateway.tls.local import probe_context

MODELS_JSON = '{"object":"list","data":[{"id":"m"}]}'
# The answer to the bench POST: an OpenAI chat completion with usage (~300 B).
CHAT_JSON = (
    '{"id":"chatcmpl-bench","object":"chat.completion","created":1,"model":"llama-3-8b",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, dear gateway."},'
    '"finish_reason":"stop"}],"usage":{"prompt_tokens":24,"completion_tokens":6,'
    '"total_tokens":30}}'
)
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


class Procs:
    """Children started by the bench, each with its output in a file; `stop_all` ends them all."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        try:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        finally:
            out.close()
        self.children.append((name, p))
        return p

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.tmp / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(STOP_TIMEOUT_S)

    def stop_all(self) -> None:
        for _, p in reversed(self.children):
            try:
                self.stop(p)
            except Exception as e:  # keep stopping the others
                print(f"bench: could not stop pid {p.pid}: {e}", file=sys.stderr)
        self.children.clear()


def pinned(cpus: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def _ports_below_ephemeral() -> Iterator[int]:
    """Ports just below the kernel's ephemeral range, from a random start, each once per process.

    A port the kernel hands out (bind to port 0) is in the ephemeral range, where it can also be
    taken as the source port of an outgoing connection before the process meant to listen on it
    binds it; a connect to it then may even meet itself (TCP simultaneous open) and pass for a
    listener. Below the range neither happens."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - 12000)
    span = low - first
    start = random.randrange(span) if span > 0 else 0
    for i in range(span):
        yield first + (start + i) % span


_PORTS = _ports_below_ephemeral()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to on `host` now, not handed out before by this process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in _PORTS:
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:
        s.bind((host, 0))  # the range is spent: the kernel's choice
        chosen: int = s.getsockname()[1]
        return chosen


# ---------------------------------------------------------------------------- /proc CPU


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(int(entry))[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name: [0] is state (field 3), [1] ppid."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """utime+stime of `pid` and its live descendants, plus its reaped children (cutime+cstime)."""
    ticks = 0
    for i, p in enumerate([pid, *_descendants(pid)]):
        try:
            f = _stat_fields(p)
        except OSError:
            continue
        ticks += int(f[11]) + int(f[12]) + (int(f[13]) + int(f[14]) if i == 0 else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def core_ticks(cores: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks of `cores` from /proc/stat (busy: all but idle and iowait)."""
    busy = total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *vals = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            ticks = [int(v) for v in vals[:8]]
            busy += sum(ticks) - ticks[3] - ticks[4]
            total += sum(ticks)
    return busy, total


# ---------------------------------------------------------------------------- readiness


def wait_until(
    what: str,
    check: Callable[[], bool],
    procs: Sequence[subprocess.Popen[bytes]],
    timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Call `check()` until it returns True; fail if a process in `procs` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: process {p.pid} exited with {p.returncode}")
        try:
            if check():
                return
        except Exception as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{what}: not ready after {timeout_s:.0f}s ({last})")


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    ctx = None
    if url.startswith("https:"):  # a readiness probe of a bench process on a private CA
        ctx = probe_context()
    try:
        req = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(req, timeout=2, context=ctx) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()


def http_ok(url: str) -> bool:
    status, _ = http_get(url)
    return status == 200


def models_ok(url: str, headers: dict[str, str] | None = None) -> bool:
    """GET `url` answers 200 with an OpenAI-style model list (the HTTP rows' probe)."""
    status, data = http_get(url, headers)
    try:
        return status == 200 and json.loads(data).get("object") == "list"
    except ValueError:
        return False


# ---------------------------------------------------------------------------- nginx


def nginx_conf(
    tmp: Path, port: int, upstream: int | None, tls: tuple[Path, Path] | None = None
) -> str:
    """nginx serving `/v1/models` and `/v1/chat/completions` itself (`upstream` None) or
    proxying to `upstream`; with `tls` (certificate chain, key) it listens with TLS as Sluice
    does (`_nginx_tls`)."""
    if upstream is None:
        location = (
            f"location /v1/models {{ default_type application/json; return 200 '{MODELS_JSON}'; }}"
            f" location /v1/chat/completions {{ default_type application/json; "
            f"return 200 '{CHAT_JSON}'; }}"
        )
        upstream_block = ""
    else:
        upstream_block = (
            f"upstream be {{ server 127.0.0.1:{upstream}; keepalive 64; "
            "keepalive_requests 1000000; }"
        )
        location = (
            "location / { proxy_pass http://be; proxy_http_version 1.1; "
            'proxy_set_header Connection ""; }'
        )
    temps = " ".join(
        f"{k}_temp_path {tmp}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
master_process off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  {temps}
  keepalive_requests 1000000;
  {upstream_block}
  server {{
    listen 127.0.0.1:{port} backlog=4096{" ssl" if tls else ""};
    {_nginx_tls(tls) if tls else ""}
    {location}
  }}
}}
"""


def _nginx_tls(tls: tuple[Path, Path]) -> str:
    """nginx's TLS settings, like for like with Sluice's listener: TLS 1.2 and 1.3 (nginx before
    1.23.4 offers no TLS 1.3 unless told, and its clients then measure TLS 1.2, whose resumption
    skips the key exchange a TLS 1.3 one makes), session tickets on and one per full handshake
    as Sluice sends (OpenSSL's default is two, ~30 µs each), nginx's default
    `ssl_session_cache none` (resumption by ticket only). The rest is stock."""
    return (
        f"ssl_certificate {tls[0]}; ssl_certificate_key {tls[1]}; "
        "ssl_protocols TLSv1.2 TLSv1.3; ssl_session_tickets on; ssl_session_cache none; "
        "ssl_conf_command NumTickets 1;"
    )


def start_nginx(
    procs: Procs,
    name: str,
    cpus: str,
    upstream: int | None,
    tls: tuple[Path, Path] | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    d = procs.tmp / name
    d.mkdir()
    port = free_port()
    (d / "nginx.conf").write_text(nginx_conf(d, port, upstream, tls))
    cmd = ["nginx", "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")]
    p = procs.start(name, pinned(cpus, cmd))
    url = f"http{'s' if tls else ''}://127.0.0.1:{port}/v1/models"
    try:
        wait_until(name, lambda: models_ok(url), [p])
    except Exception as e:
        err = (d / "error.log").read_text(errors="replace") if (d / "error.log").exists() else ""
        raise RuntimeError(f"{e}\n{procs.tail(name)}\n{err}") from e
    return p, port


# ---------------------------------------------------------------------------- cores


def cpu_list(spec: str) -> set[int]:
    """The cores of a `taskset -c` list such as "0,2-3"."""
    cpus: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def check_pinning(args: argparse.Namespace, notes: list[str]) -> None:
    """Clear `--gateway-cpus` / `--load-cpus` in `args` when they cannot be used; note why."""
    allowed = os.sched_getaffinity(0)
    if not shutil.which("taskset"):
        args.gateway_cpus = args.load_cpus = ""
        notes.append("taskset not found: nothing is pinned")
        return
    for opt in ("gateway_cpus", "load_cpus"):
        spec = getattr(args, opt)
        cpus = cpu_list(spec)
        if spec and not cpus <= allowed:
            notes.append(f"--{opt.replace('_', '-')} {spec}: not all available; not pinned")
            setattr(args, opt, "")
    notes.append(
        f"cores: proxies on {args.gateway_cpus or 'any'}, "
        f"load generators and backends on {args.load_cpus or 'any'} "
        f"(machine has {os.cpu_count()})"
    )


def wait_idle(limit_s: float, notes: list[str]) -> None:
    """Wait (1 s samples, at most `limit_s`) until every core is < 15 % busy; note the outcome."""
    cores = os.sched_getaffinity(0)
    deadline = time.monotonic() + limit_s
    while True:
        busy = []
        before = {c: core_ticks({c}) for c in cores}
        time.sleep(1.0)
        for c in sorted(cores):
            b, t = core_ticks({c})
            busy.append(100 * (b - before[c][0]) / max(1, t - before[c][1]))
        if max(busy) < 15:
            return
        if time.monotonic() >= deadline:
            shown = ", ".join(
                f"core {c} {v:.0f} %" for c, v in zip(sorted(cores), busy, strict=True)
            )
            notes.append(
                f"the machine was not idle before the run ({shown} busy): figures are noisy"
            )
            return
