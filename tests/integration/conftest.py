"""Real processes: the simulated backend and the gateway, each a `python -m gateway` child."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import Proc, free_port, wait_for_port, wait_until


def http_json(url: str, method: str = "GET", body: Any = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def readiness(admin_port: int) -> tuple[int, Any]:
    """GET /readyz: its status (503 while starting or draining) and its JSON. OSError when nothing
    answers, ValueError when what answers is not JSON."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/readyz", timeout=1) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:  # the error holds the response socket open
            return e.code, json.loads(e.read() or b"null")


def wait_ready(admin_port: int, proc: Proc, timeout: float = 30.0) -> None:
    wait_until(lambda: readiness(admin_port), timeout, ok=lambda r: r[0] == 200, interval=0.1,
               what=f"/readyz on :{admin_port} answering 200", proc=proc,
               ignore=(OSError, ValueError))  # fmt: skip


@dataclass
class Backend:
    """A `sluice mock-backend` process; its admin API is on a loopback listener of its own."""

    proc: Proc
    http_port: int
    grpc_port: int
    admin_port: int

    def stats(self) -> Any:
        return http_json(f"http://127.0.0.1:{self.admin_port}/admin/stats")

    def knobs(self, **changes: Any) -> Any:
        if not changes:
            return http_json(f"http://127.0.0.1:{self.admin_port}/admin/knobs")
        return http_json(f"http://127.0.0.1:{self.admin_port}/admin/knobs", "POST", changes)

    def reset(self) -> None:
        http_json(f"http://127.0.0.1:{self.admin_port}/admin/reset", "POST", {})


def policy_yaml(backend: Backend, http: int, grpc: int, admin: int, **extra: str) -> str:
    timeouts = extra.get("timeouts", "first_byte_s: 5\n  drain_s: 10")
    return f"""\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}, engine: {extra.get("engine", "aiohttp")}}}
  grpc: {{host: 127.0.0.1, port: {grpc}, engine: {extra.get("grpc_engine", "h2")}}}
  admin: {{host: 127.0.0.1, port: {admin}}}
limits:
  max_body_bytes: 1048576
  max_header_bytes: 8192
timeouts:
  {timeouts}
backends:
  - name: sim-http
    protocol: http
    endpoints: [{{address: "127.0.0.1:{backend.http_port}"}}]
  - name: sim-grpc
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{backend.grpc_port}"}}]
    unary_methods: [/sluice.inference.v1.Inference/Infer]
routes:
  - name: grpc
    match: {{protocol: grpc}}
    backend: sim-grpc
  - name: {extra.get("http_route_name", "openai")}
    match: {{protocol: http, path_prefix: /}}
    backend: sim-http
{extra.get("tail", "")}"""


@dataclass
class Gateway:
    proc: Proc
    policy: Path
    http_port: int
    grpc_port: int
    admin_port: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    http, grpc, admin = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("backend") / "backend.log"
    proc = Proc(
        [
            "mock-backend",
            "--http",
            f"127.0.0.1:{http}",
            "--grpc",
            f"127.0.0.1:{grpc}",
            "--admin",
            f"127.0.0.1:{admin}",
            "--ttft-ms",
            "20",
            "--token-delay-ms",
            "20",
        ],
        log,
    )
    try:
        wait_for_port(http)
        wait_for_port(grpc)
        wait_for_port(admin)
        yield Backend(proc, http, grpc, admin)
    finally:
        proc.stop()


def start_gateway(
    backend: Backend, tmp: Path, workers: int = 1, env: dict[str, str] | None = None, **extra: str
) -> Gateway:
    http, grpc, admin = free_port(), free_port(), free_port()
    policy = tmp / "policy.yaml"
    policy.write_text(policy_yaml(backend, http, grpc, admin, **extra))
    proc = Proc(
        ["serve", "--policy", str(policy), "--workers", str(workers)],
        tmp / "gateway.log",
        env={"SLUICE_WATCH_INTERVAL": "0.2", **(env or {})},
    )
    wait_ready(admin, proc)
    return Gateway(proc, policy, http, grpc, admin)


@pytest.fixture(scope="module", params=["aiohttp", "native"])
def gateway(
    request: pytest.FixtureRequest, backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """A gateway process per HTTP ingress engine (listeners.http.engine); the native one
    serves gRPC on the h2 engine, the aiohttp one on grpcio, so the proxy tests cover both gRPC
    engines without more processes."""
    grpc_engine = "h2" if request.param == "native" else "grpcio"
    gw = start_gateway(
        backend, tmp_path_factory.mktemp("gateway"), engine=request.param, grpc_engine=grpc_engine
    )
    try:
        yield gw
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    """Start simulated backends (`backends_support.start_sims`); every one is stopped at the
    end of the test."""
    from tests.integration.backends_support import Sim, start_sims

    started: list[Sim] = []

    def start(n: int, *args: str, grpc: bool = False) -> list[Sim]:
        sims = start_sims(tmp_path, n, *args, grpc=grpc)
        started.extend(sims)
        return sims

    yield start
    for s in started:
        s.proc.stop()
