"""The processes `sluice bench` measures: the mock backend, the floor proxies, Sluice gateways.

A `Variant` is one Sluice configuration under test (HTTP engine, filter chain, tracing); its
`label` names its rows. `policy_doc` writes the bench policy of a variant (`--policy-extra`
merged over it), `start_gateway` runs `sluice serve` with it and waits for `/readyz`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gateway.bench.loads import (
    CHAT_BODY,
    CHAT_PATH,
    INFER,
    MakeCmd,
    Parse,
    grpc_load,
    grpc_ok,
    h2c_load,
    post_script,
    wrk_cmd,
)
from gateway.bench.procs import (
    READY_TIMEOUT_S,
    Procs,
    free_port,
    http_ok,
    models_ok,
    pinned,
    wait_until,
)
from gateway.bench.report import Row

if TYPE_CHECKING:
    from gateway.bench.full import FullChain

BackendStats = Callable[[], tuple[int, int]]  # the mock backend's (completed, failed) so far
RunRow = Callable[[Row, MakeCmd, Parse, int | None], Row]  # measure one row against a pid
Edit = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass
class Setup:
    args: argparse.Namespace
    procs: Procs
    notes: list[str] = field(default_factory=list)
    _full: FullChain | None = None

    @property
    def gw_cpus(self) -> str:
        return str(self.args.gateway_cpus)

    @property
    def load_cpus(self) -> str:
        return str(self.args.load_cpus)

    def url(self, port: int) -> str:
        """What the HTTP rows request on `port` (`--method`: the chat POST, or the model list)."""
        path = CHAT_PATH if self.post else "/v1/models"
        return f"http://127.0.0.1:{port}{path}"

    @property
    def post(self) -> bool:
        return getattr(self.args, "method", "post") == "post"

    def wrk(self, url: str, extra: Sequence[str] = ()) -> MakeCmd:
        """wrk on `url` (from `url()`), sending the chat POST unless `--method get`."""
        script = ["-s", str(post_script(self.procs.tmp))] if self.post else []
        return wrk_cmd(self.load_cpus, self.args.connections, url, [*script, *extra])

    def h2load(
        self, name: str, url: str, extra: Sequence[str], connections: int, streams: int
    ) -> tuple[MakeCmd, Parse]:
        """h2load on `url` over h2c, `connections` × `streams` in flight, sending the chat POST
        unless `--method get` (as `wrk`, over HTTP/2)."""
        chat = self.procs.tmp / "chat.json" if self.post else None
        if chat is not None:
            chat.write_text(CHAT_BODY)
        tmp, cpus = self.procs.tmp, self.load_cpus
        return h2c_load(tmp, cpus, connections, streams, name, url, chat, extra)

    def full_chain(self) -> FullChain:
        """The full chain's secret and token (made once per run)."""
        if self._full is None:
            from gateway.bench.full import prepare

            self._full = prepare(self.procs.tmp)
        return self._full

    def headers(self, variant: Variant) -> list[str]:
        """wrk `-H` arguments a variant's requests need: the full chain's token, sent to the
        chain without auth too (passed through unread), so that the two differ by the filter's
        work and not by the bytes of a header one of them never sees."""
        return self.full_chain().wrk_headers if variant.full else []

    def grpc(self, name: str, port: int) -> tuple[MakeCmd, Parse]:
        a = self.args
        return grpc_load(
            self.procs.tmp, self.load_cpus, a.grpc_connections, a.grpc_streams, name, port
        )

    def extra(self) -> dict[str, Any] | None:
        """The `--policy-extra` document, if any."""
        path = self.args.policy_extra
        doc = yaml.safe_load(Path(path).read_text()) if path else None
        if doc is not None and not isinstance(doc, dict):
            raise ValueError(f"{path}: --policy-extra must hold a mapping")
        return doc


@dataclass(frozen=True)
class Variant:
    """One Sluice configuration: `engine` None for gRPC-only gateways, `chain` None for the
    policy's default chain, `grpc_engine` (listeners.grpc.engine) None for the policy's, `full`
    the full chain of `gateway.bench.full` (JWT, rate limits, tracing, breaker, retries)."""

    engine: str | None
    chain: tuple[str, ...] | None = None
    tracing: bool = False
    grpc_engine: str | None = None
    full: bool = False
    without: str | None = None  # the full chain minus one of `gateway.bench.full.FEATURES`

    @property
    def label(self) -> str:
        parts = [self.engine] if self.engine else []
        if self.grpc_engine:
            parts.append(self.grpc_engine)
        if self.chain is not None:
            parts.append(",".join(self.chain) or "no filters")
        if self.tracing:
            parts.append("+ tail sampling")
        if self.full:
            parts.append("full chain" + (f" − {self.without}" if self.without else ""))
        return f"({', '.join(parts)})" if parts else ""

    def filters(self) -> list[str] | None:
        """The policy's `filters:`; tracing needs `trace`, put where the default order has it."""
        if self.chain is None or not self.tracing or "trace" in self.chain:
            return None if self.chain is None else list(self.chain)
        from gateway.policy.model import DEFAULT_FILTERS

        rank: dict[str, int] = {f: i for i, f in enumerate(DEFAULT_FILTERS)}
        return sorted([*self.chain, "trace"], key=lambda f: rank.get(f, len(rank)))


def parse_chains(specs: list[str] | None) -> list[tuple[str, ...] | None]:
    """`--filters` values (each `a,b,c`, or `default`) → chains; none given: the default one."""
    if not specs:
        return [None]
    return [None if s == "default" else tuple(f for f in s.split(",") if f) for s in specs]


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
    variant: Variant,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The bench policy of `variant`; `extra` (`--policy-extra`) is merged over it (the sections
    a filter needs, e.g. `auth:`), so a new filter needs no change here."""
    backends: list[dict[str, Any]] = []
    routes: list[dict[str, Any]] = []
    listeners: dict[str, Any] = {"http": None, "grpc": None}
    listeners["admin"] = {"host": "127.0.0.1", "port": ports["admin"]}
    if grpc_backend is not None:
        listeners["grpc"] = {"host": "127.0.0.1", "port": ports["grpc"]}
        if variant.grpc_engine:
            listeners["grpc"]["engine"] = variant.grpc_engine
        endpoints = [{"address": f"127.0.0.1:{grpc_backend}"}]
        backends.append(
            {"name": "bench-grpc", "protocol": "grpc", "endpoints": endpoints}
            | {"unary_methods": [INFER]}
        )
        routes.append({"name": "grpc", "match": {"protocol": "grpc"}, "backend": "bench-grpc"})
    if http_backend is not None:
        listeners["http"] = {"host": "127.0.0.1", "port": ports["http"]}
        if variant.engine:
            listeners["http"]["engine"] = variant.engine
        endpoints = [{"address": f"127.0.0.1:{http_backend}"}]
        backends.append({"name": "bench-http", "protocol": "http", "endpoints": endpoints})
        match = {"protocol": "http", "path_prefix": "/"}
        routes.append({"name": "http", "match": match, "backend": "bench-http"})
    doc: dict[str, Any] = {
        "version": 1,
        "listeners": listeners,
        "backends": backends,
        "routes": routes,
        "access_log": {"enabled": access_log},
        "mock_backend": {"enabled": False},
        # h2load does not open a new connection after a GOAWAY: no request cap per connection.
        "limits": {"http2": {"max_requests_per_connection": 1 << 30}},
    }
    filters = variant.filters()
    if filters is not None:
        doc["filters"] = filters
    if variant.tracing:  # tail sampling as shipped: OK requests are not kept, nothing is exported
        doc["tracing"] = {"enabled": True, "sample_ratio": 1e-5, "slow_ms": 2000}
    return merge(doc, extra) if extra else doc


def start_gateway(
    s: Setup,
    http_backend: int | None,
    grpc_backend: int | None,
    variant: Variant,
    name: str,
    edit: Edit | None = None,
    runner: Sequence[str] = ("-m", "gateway"),
    under: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """`sluice serve` with the bench policy of `variant` (then `edit`), ready on `/readyz`;
    `runner`: what the interpreter runs in place of `-m gateway` (a wrapper that takes the same
    arguments, e.g. `tests/bench/count_calls.py`'s counting child); `under`: a command the
    interpreter runs under (valgrind), given ten times longer to be ready."""
    from gateway.policy.model import Policy

    ports = {"http": free_port(), "grpc": free_port(), "admin": free_port()}
    access_log = not s.args.no_access_log
    doc = policy_doc(ports, http_backend, grpc_backend, access_log, variant, s.extra())
    if variant.full:
        from gateway.bench.full import with_full_chain

        doc = with_full_chain(doc, s.full_chain(), variant.without)
    if edit is not None:
        doc = edit(doc)
    Policy.model_validate(doc)  # fail here, with the reason, rather than in the child
    path = s.procs.tmp / f"{name}-policy.yaml"
    path.write_text(json.dumps(doc, indent=2) + "\n")  # JSON is YAML
    cmd = [*under, sys.executable, *runner, "serve", "--policy", str(path), "--log-level", "INFO"]
    workers = getattr(s.args, "workers", 1)
    if workers > 1 and variant.engine is not None:
        cmd += ["--workers", str(workers)]
    p = s.procs.start(name, pinned(s.gw_cpus, cmd))
    try:
        ready = lambda: http_ok(f"http://127.0.0.1:{ports['admin']}/readyz")  # noqa: E731
        wait_until(name, ready, [p], READY_TIMEOUT_S * (10 if under else 1))
    except Exception as e:
        raise RuntimeError(f"{e}\n{s.procs.tail(name)}") from e
    return p, ports


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


def mock_stats(admin_port: int) -> BackendStats:
    """A function returning (completed, failed) from the mock backend's /admin/stats."""

    def read() -> tuple[int, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/admin/stats", timeout=2) as r:
            d = json.loads(r.read())
        return int(d["completed"]), int(d["failed"])

    return read


def start_floor(
    s: Setup, http_backend: int, callbacks: bool = False
) -> tuple[subprocess.Popen[bytes], int]:
    """The bare Protocol + httptools proxy (`gateway.bench.floor`), pinned like the proxies;
    `callbacks`: its variant without a task per request."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.bench.floor", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--upstream", f"127.0.0.1:{http_backend}", *(["--callbacks"] if callbacks else [])]
    p = s.procs.start("floor", pinned(s.gw_cpus, cmd))
    url = f"http://127.0.0.1:{port}/v1/models"
    try:
        wait_until("floor proxy", lambda: models_ok(url), [p])
    except Exception as e:
        raise RuntimeError(f"{e}\n{s.procs.tail('floor')}") from e
    return p, port


def h2c_ok(url: str) -> bool:
    """One h2c (prior knowledge) GET of `url` through h2load answers 2xx."""
    r = subprocess.run(
        ["h2load", "-n1", "-c1", url], capture_output=True, text=True, timeout=10, check=False
    )
    return "1 succeeded" in r.stdout and "status codes: 1 2xx" in r.stdout


def start_h2floor(s: Setup, http_backend: int) -> tuple[subprocess.Popen[bytes], int]:
    """The bare Protocol + h2 (h2c) proxy (`gateway.bench.h2floor`), pinned like the proxies."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.bench.h2floor", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--upstream", f"127.0.0.1:{http_backend}"]
    p = s.procs.start("h2floor", pinned(s.gw_cpus, cmd))
    try:
        wait_until("h2 floor proxy", lambda: h2c_ok(f"http://127.0.0.1:{port}/v1/models"), [p])
    except Exception as e:
        raise RuntimeError(f"{e}\n{s.procs.tail('h2floor')}") from e
    return p, port
