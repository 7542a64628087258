"""Real `sluice serve` processes over one private redis-server: Redis heartbeat discovery and
Redis-backed limits share one client owner across reloads, and every start and stop ends (a
taken port with Redis sections exits non-zero within drain_s; SIGTERM while starting or
draining ends the process)."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.backends_support import (
    Load,
    Sim,
    policy_text,
    rewrite,
    start_gateway,
    start_sims,
)
from tests.integration.conftest import http_json
from tests.redis_support import RedisServer
from tests.support import Proc, free_port, until, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.redis]


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    try:
        yield server
    finally:
        server.stop()


def discovery(sim: Sim, redis: RedisServer) -> str:
    """A backend with a static member and members from Redis heartbeats (none are sent)."""
    return f"""\
backends:
  - name: llm
    protocol: http
    endpoints: [{{address: "{sim.address}"}}]
    discovery: {{registry: {{redis: "{redis.url}", service: llm, poll_s: 0.1}}}}
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: llm
"""


def limits(redis: RedisServer) -> str:
    return f"""\
rate_limits:
  store: {{redis: {{url: "{redis.url}", sync_interval_ms: 50}}}}
  rules:
    - name: per-ip
      key: [source_ip]
      qps: 100000
"""


def policy_status(admin: int) -> dict:  # type: ignore[type-arg]
    return http_json(f"http://127.0.0.1:{admin}/admin/policy")["status"]  # type: ignore[no-any-return]


def readyz(admin: int) -> dict:  # type: ignore[type-arg]
    return http_json(f"http://127.0.0.1:{admin}/readyz")  # type: ignore[no-any-return]


async def test_redis_discovery_gains_redis_limits_by_reload_and_loses_them(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    sim = start_sims(tmp_path, 1, "--ttft-ms", "1", "--completion-tokens", "1")[0]
    gw = start_gateway(tmp_path, discovery(sim, redis_server))
    # One client, held all along (by the registry, by the limiter too while it has Redis): none
    # is closed, none waits to be.
    held = {"clients": [redis_server.url], "retired": 0}
    try:
        assert readyz(gw.admin_port)["redis"] == held
        async with Load(gw.url, workers=4) as load:
            await load.answered(10)
            v1 = gw.version()
            rewrite(gw, discovery(sim, redis_server) + limits(redis_server))
            await until(lambda: gw.version() != v1, 10)
            st = policy_status(gw.admin_port)
            assert st["last_reload"]["ok"] is True, st
            # the limiter reached Redis through the client the registry already used
            await until(lambda: readyz(gw.admin_port)["ratelimit"]["mode"] == "redis", 10)
            ready = readyz(gw.admin_port)
            assert ready["redis"] == held, ready
            assert gw.backends()["backends"]["llm"]["registry"]["up"] is True
            await load.answered(10)
            v2 = gw.version()
            rewrite(gw, discovery(sim, redis_server))  # and back
            await until(lambda: gw.version() != v2, 10)
            assert policy_status(gw.admin_port)["last_reload"]["ok"] is True
            await load.answered(10)
        assert load.ok() > 0 and not load.failures(), load.failures()[:5]
        assert readyz(gw.admin_port)["redis"] == held
    finally:
        out = gw.stop()
        sim.proc.stop()
    assert "failed" not in out and "Traceback" not in out, out


def wait_for_line(proc: Proc, text: str, timeout: float = 30.0) -> float:
    wait_until(lambda: text in proc.output(), timeout, interval=0.02, what=repr(text), proc=proc)
    return time.monotonic()


def exits_within(proc: Proc, seconds: float) -> int:
    try:
        return proc.popen.wait(seconds)
    except Exception:
        proc.stop()
        raise AssertionError(f"still running after {seconds}s:\n{proc.output()}") from None


def test_a_taken_port_with_redis_sections_exits_non_zero_within_drain_s(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    drain_s = 2.0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        body = f"""\
timeouts: {{drain_s: {drain_s}}}
backends:
  - name: llm
    protocol: http
    endpoints: [{{address: "127.0.0.1:{free_port()}"}}]
    discovery: {{registry: {{redis: "{redis_server.url}", service: llm, poll_s: 0.05}}}}
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: llm
{limits(redis_server)}"""
        path = tmp_path / "policy.yaml"
        path.write_text(policy_text(port, free_port(), free_port(), body))
        proc = Proc(["serve", "--policy", str(path)], tmp_path / "gateway.log")
        try:
            failed_at = wait_for_line(proc, "start failed")
            code = exits_within(proc, drain_s)
        finally:
            proc.stop()
    assert code == 1, proc.output()
    assert time.monotonic() - failed_at < drain_s + 0.5
    assert "address already in use" in proc.output()


def sigterm_caught(pid: int) -> bool:
    """Whether the process has installed its SIGTERM handler (the event loop runs)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_sigterm_while_starting_ends_the_process(tmp_path: Path, redis_server: RedisServer) -> None:
    # The gRPC listener and the simulated backend make the start long enough to land in it.
    mock = (
        f"mock_backend: {{enabled: true, http: 127.0.0.1:{free_port()}, grpc: null, admin: null}}"
    )
    body = f"timeouts: {{drain_s: 20}}\n{mock}\n{limits(redis_server)}"
    path = tmp_path / "policy.yaml"
    path.write_text(policy_text(free_port(), free_port(), free_port(), body))
    proc = Proc(["serve", "--policy", str(path)], tmp_path / "gateway.log")
    try:
        deadline = time.monotonic() + 30
        while not sigterm_caught(proc.popen.pid):
            assert time.monotonic() < deadline and proc.popen.poll() is None, proc.output()
            time.sleep(0.001)
        proc.popen.send_signal(signal.SIGTERM)
        code = exits_within(proc, 10)
    finally:
        proc.stop()
    out = proc.output()
    assert code == 0, out
    assert "stop requested while starting" in out and "sluice ready" not in out, out
    assert "stopped" in out


async def test_sigterm_while_draining_ends_the_process(tmp_path: Path) -> None:
    sim = start_sims(tmp_path, 1, "--ttft-ms", "60000")[0]  # answers in a minute
    body = f"""\
timeouts: {{drain_s: 60, first_byte_s: 120}}
backends:
  - name: llm
    protocol: http
    endpoints: [{{address: "{sim.address}"}}]
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: llm
"""
    gw = start_gateway(tmp_path, body)
    try:
        async with Load(gw.url, workers=2):
            await until(lambda: readyz(gw.admin_port)["in_flight"] == 2, 10)
            gw.proc.popen.send_signal(signal.SIGTERM)
            wait_for_line(gw.proc, "draining")
            time.sleep(0.3)  # the subject: a gateway that did not wait for its two would exit
            assert gw.proc.popen.poll() is None  # still draining its two requests
            gw.proc.popen.send_signal(signal.SIGTERM)
            code = exits_within(gw.proc, 10)
        assert code == 0, gw.proc.output()
        assert "cutting the requests still in flight" in gw.proc.output()
    finally:
        gw.proc.stop()
        sim.proc.stop()
