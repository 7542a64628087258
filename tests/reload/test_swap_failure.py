"""A policy whose activation fails is not half-applied: the swap is undone, the previous policy
keeps serving (its owners configured for it again), and the reload reports the failure."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

import gateway.filters.registry as registry
from gateway.adapters.engines import start_http
from gateway.app import Gateway
from gateway.context import RequestContext, Status
from gateway.policy.compiled import CompiledPolicy
from gateway.policy.model import Rollout
from gateway.reload.holder import PolicyHolder
from gateway.services import ServiceKey, Services
from gateway.telemetry import metrics
from tests.forward.test_phases import upstream

BAD_CONNECT_S = 9  # the owner below refuses a policy with this connect timeout


class Switchboard:
    """A long-lived owner configured at activation, as the limiter or JWKS caches are; it
    cannot take a policy whose connect timeout is BAD_CONNECT_S."""

    def __init__(self) -> None:
        self.activated: list[float] = []  # connect_s of each policy it was configured for

    def activate(self, policy: CompiledPolicy) -> None:
        connect_s = policy.policy.timeouts.connect_s
        self.activated.append(connect_s)
        if connect_s == BAD_CONNECT_S:
            raise RuntimeError("switchboard cannot take this policy")


SWITCHBOARD: Final = ServiceKey[Switchboard]("test.switchboard")


class Switched:
    name = "request_id"

    def __init__(self, policy: CompiledPolicy, board: Switchboard) -> None:
        self.policy, self.board = policy, board

    def activate(self) -> None:
        self.board.activate(self.policy)

    def on_request(self, ctx: RequestContext) -> Status:
        return Status.CONTINUE


def build_switched(section: CompiledPolicy, services: Services) -> Switched:
    return Switched(section, services.get(SWITCHBOARD, Switchboard))


POLICY = """
version: 1
listeners: {{http: null, grpc: null, admin: null}}
access_log: {{enabled: false}}
timeouts: {{connect_s: {connect}}}
backends:
  - name: up
    endpoints: [{{address: "127.0.0.1:{port}"}}]
routes:
  - name: all
    match: {{path_prefix: {prefix}}}
    backend: up
"""


def reloads(result: str) -> float:
    return metrics.REGISTRY.get_sample_value("sluice_policy_reloads_total", {"result": result}) or 0


async def test_an_owner_that_fails_activation_fails_the_reload_under_traffic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        registry.FILTERS,
        "request_id",
        registry.FilterSpec("tests.reload.test_swap_failure:build_switched", lambda c: c),
    )
    async with upstream() as up:
        path = tmp_path / "policy.yaml"
        path.write_text(POLICY.format(port=up.port, connect=1, prefix="/"))
        gw = Gateway(path)
        listener = await start_http(gw, "127.0.0.1", 0, engine="native")
        board = gw.services.get(SWITCHBOARD, Switchboard)
        v1 = gw.holder.version
        errors_before = reloads("error")
        stop = asyncio.Event()
        load: asyncio.Future[list[list[int]]] | None = None
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{listener.port}") as c:

                async def traffic() -> list[int]:
                    statuses = []
                    while not stop.is_set():
                        async with c.post("/echo", data=b"x") as r:
                            await r.read()
                            statuses.append(r.status)
                    return statuses

                load = asyncio.gather(traffic(), traffic())
                await asyncio.sleep(0.05)
                # The bad policy would also stop routing /echo: it must never serve (forced
                # past the change guard, which would hold it for that reason).
                path.write_text(POLICY.format(port=up.port, connect=BAD_CONNECT_S, prefix="/x/"))
                result = gw.holder.reload(force=True)
                assert not result.ok and not result.changed and result.version == v1
                assert "cannot activate policy" in result.errors[0], result.errors
                assert "RuntimeError: switchboard cannot take this policy" in result.errors[0]
                assert gw.holder.version == v1 and gw.active.policy.version == v1
                # configured for the bad one, then for the one that serves again
                assert board.activated == [1, BAD_CONNECT_S, 1]
                await asyncio.sleep(0.05)
                # a good change afterwards applies normally
                path.write_text(POLICY.format(port=up.port, connect=2, prefix="/"))
                good = gw.holder.reload()
                assert good.ok and good.changed
                assert board.activated[-1] == 2
                await asyncio.sleep(0.05)
                stop.set()
                statuses = [s for part in await load for s in part]
        finally:
            stop.set()
            if load is not None and not load.done():
                await asyncio.wait([load], timeout=5)
            await listener.close(1.0)
            await gw.aclose()
    assert statuses and set(statuses) == {200}, set(statuses)
    status: dict[str, Any] = gw.holder.status()
    assert status["last_reload"]["ok"] is True  # the good one came last
    assert any("cannot activate policy" in e for e in status["last_error"]["errors"])
    assert reloads("error") == errors_before + 1
    events = [e["event"] for e in status["events"]]
    assert events[-2:] == ["rejected", "applied"], events


def make_holder(tmp_path: Path) -> tuple[PolicyHolder[CompiledPolicy], Path]:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(port=9, connect=1, prefix="/"))
    return PolicyHolder(path, lambda c: c), path


def test_a_swap_subscriber_that_raises_reports_the_reload_failed(tmp_path: Path) -> None:
    holder, path = make_holder(tmp_path)
    v1 = holder.version
    seen: list[float] = []

    def owner() -> None:
        seen.append(holder.compiled.policy.timeouts.connect_s)
        if holder.compiled.policy.timeouts.connect_s == BAD_CONNECT_S:
            raise TypeError("get() got an unexpected keyword argument 'cluster'")

    holder.on_swap(owner)
    path.write_text(POLICY.format(port=9, connect=BAD_CONNECT_S, prefix="/"))
    result = holder.reload()
    assert not result.ok and holder.version == v1 and seen == [BAD_CONNECT_S, 1]
    assert "unexpected keyword argument 'cluster'" in result.errors[0]
    st = holder.status()
    assert st["last_reload"]["ok"] is False and st["version"] == v1
    assert metrics.REGISTRY.get_sample_value("sluice_policy_last_reload_success") == 0


def test_a_candidate_that_fails_activation_starts_no_rollout(tmp_path: Path) -> None:
    holder, path = make_holder(tmp_path)
    v1 = holder.version
    swaps: list[str] = []
    holder.on_swap(lambda: swaps.append(holder.version))

    def candidate(snap: CompiledPolicy) -> None:
        raise RuntimeError("candidate owner refused")

    holder.on_candidate(candidate)
    path.write_text(POLICY.format(port=9, connect=2, prefix="/"))
    result = holder.reload(rollout=Rollout(stages=["10", "100"], hold_s=1))
    assert not result.ok and not result.rollout and holder.rollout is None
    assert "cannot activate candidate" in result.errors[0]
    assert holder.version == v1 and swaps == [v1]  # the stable policy was activated again


def test_a_rollout_whose_completion_fails_activation_is_rolled_back(tmp_path: Path) -> None:
    holder, path = make_holder(tmp_path)
    v1 = holder.version
    seen: list[str] = []

    def owner() -> None:
        seen.append(holder.version)
        if holder.version != v1:
            raise RuntimeError("owner refused the completed policy")

    holder.on_swap(owner)
    path.write_text(POLICY.format(port=9, connect=2, prefix="/"))
    started = holder.reload(rollout=Rollout(stages=["50", "100"], hold_s=1))
    assert started.ok and started.rollout and holder.rollout is not None
    v2 = holder.rollout.to_version
    holder.promote()  # 50 % -> 100 %
    holder.promote()  # 100 % -> complete: the swap fails, the stable policy serves again
    assert holder.rollout is None and holder.version == v1
    assert seen == [v2, v1]
    last = holder.rollout_status()
    assert last is not None and last["phase"] == "rolled_back"
    assert "cannot activate policy" in last["stopped"]["reason"]
    assert [e["event"] for e in holder.status()["events"]][-1] == "rolled_back"
    again = holder.reload()  # the same change is held until forced
    assert again.held and holder.version == v1
