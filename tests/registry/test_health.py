"""Active health checks against the real simulated backend (HTTP GET /healthz?deep=true and
grpc.health.v1), the thresholds through the pool, faster checks while failing, and passive
health (a failure seen in traffic runs a check at once)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from gateway.core.outcome import Outcome
from gateway.mockbackend import Knobs, MockBackendHandle, start_mock_backend
from gateway.policy.model import Backend
from gateway.registry.health import check_grpc, check_http
from gateway.registry.member import Attempt
from gateway.registry.pool import BACKENDS, BackendPool
from gateway.services import Services
from tests.support import free_port, until


@pytest.fixture
async def backend() -> AsyncIterator[MockBackendHandle]:
    handle = await start_mock_backend("127.0.0.1:0", "127.0.0.1:0", Knobs(ttft_ms=0))
    yield handle
    await handle.close()


async def test_http_check(backend: MockBackendHandle) -> None:
    assert backend.http_port is not None
    assert await check_http("127.0.0.1", backend.http_port, "/healthz?deep=true", 1.0) == (True, "")
    await backend.update_knobs({"healthy": False})
    assert await check_http("127.0.0.1", backend.http_port, "/healthz", 1.0) == (
        False, "status 503",
    )  # fmt: skip
    ok, err = await check_http("127.0.0.1", free_port(), "/healthz", 1.0)
    assert not ok and "Error" in err


async def test_http_check_times_out_on_a_silent_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)  # accepts (in the kernel backlog), never answers
        t0 = time.monotonic()
        ok, err = await check_http("127.0.0.1", s.getsockname()[1], "/healthz", 0.2)
    assert not ok and "timeout" in err and time.monotonic() - t0 < 1.0


async def test_grpc_check(backend: MockBackendHandle) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{backend.grpc_port}") as ch:
        assert await check_grpc(ch, "", 1.0) == (True, "")
        await backend.update_knobs({"healthy": False})
        assert await check_grpc(ch, "", 1.0) == (False, "NOT_SERVING")
        ok, err = await check_grpc(ch, "no.such.Service", 1.0)
        assert not ok and "NOT_FOUND" in err


def cfg(port: int, protocol: str = "http", **health: Any) -> Backend:
    h = {"interval_s": 0.2, "failing_interval_s": 0.05, "unhealthy_after": 2,
         "healthy_after": 2, "timeout_s": 0.5, **health}  # fmt: skip
    return Backend.model_validate(
        {
            "name": "b",
            "protocol": protocol,
            "health": h,
            "endpoints": [{"address": f"127.0.0.1:{port}"}],
        }  # fmt: skip
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
async def test_checker_marks_unhealthy_then_healthy(
    backend: MockBackendHandle, protocol: str, services: Services
) -> None:
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    port = backend.http_port if protocol == "http" else backend.grpc_port
    assert port is not None
    st = pool.view(cfg(port, protocol))
    pool.activate([st], {})
    (m,) = st.members.values()
    await until(lambda: m.health is not None and m.health.checks >= 1)
    assert m.health is not None and m.health.healthy
    await backend.update_knobs({"healthy": False})
    await until(lambda: m.health is not None and not m.health.healthy)
    now = time.monotonic()
    assert st.plan(now).available == 0 and st.plan(now).levels[0].panic  # sidecar: panic
    await backend.update_knobs({"healthy": True})
    await until(lambda: m.health is not None and m.health.healthy)
    await services.aclose()  # again at teardown: closing twice is harmless
    assert m.hbox is not None and (m.hbox.checker is None or m.hbox.checker.done())


async def test_passive_health_checks_at_once(
    backend: MockBackendHandle, services: Services
) -> None:
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    assert backend.http_port is not None
    st = pool.view(cfg(backend.http_port, interval_s=60, failing_interval_s=60, unhealthy_after=1))
    pool.activate([st], {})
    (m,) = st.members.values()
    await until(lambda: m.health is not None and m.health.checks == 1, timeout=3)
    await backend.update_knobs({"healthy": False})
    await asyncio.sleep(0.2)
    assert m.health is not None and m.health.checks == 1  # next active check is 60 s away
    now = time.monotonic()
    got = st.take(now, None)
    assert got is not None
    m.core.in_flight += 1
    st.report(Attempt(None, m, got[1], now, 0), now, Outcome.UPSTREAM_CONNECT, 0, None, None)
    await until(lambda: m.health is not None and not m.health.healthy, timeout=3)
