"""Members from Redis heartbeats through a real gateway: `sluice heartbeat` agents beside
simulated backends, a member whose heartbeats stop leaves rotation within the TTL, a new one
joins without a restart, and Redis going down keeps the last members serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.backends_support import Load, Sim, start_gateway, start_sims
from tests.redis_support import RedisServer
from tests.support import Proc, until

pytestmark = [pytest.mark.integration, pytest.mark.redis]

TTL = 1.5  # the agents' TTL and the gateway's stale_after_s (golden: 5 s; short for the test)


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def agent(tmp: Path, redis: RedisServer, sim: Sim) -> Proc:
    return Proc(
        ["heartbeat", "--service", "llm", "--address", sim.address, "--interval", "0.2",
         "--ttl", str(TTL), "--ver", "v1"],
        tmp / f"agent-{sim.port}.log",
        env={"SLUICE_HEARTBEAT_REDIS": redis.url},
    )  # fmt: skip


async def test_heartbeat_members_follow_the_registry(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    sims = start_sims(tmp_path, 3, "--ttft-ms", "5", "--completion-tokens", "1")
    agents = [agent(tmp_path, redis_server, s) for s in sims[:2]]
    gw = start_gateway(tmp_path, f"""\
backends:
  - name: llm
    discovery:
      registry: {{redis: "{redis_server.url}", service: llm, poll_s: 0.2, stale_after_s: {TTL}}}
routes:
  - name: chat
    match: {{path_prefix: /v1/}}
    backend: llm
""")  # fmt: skip

    def rotation() -> set[str]:
        st = gw.backends()["backends"]["llm"]
        return {a for lv in st["levels"] for a in lv["members"]}

    try:
        await until(lambda: rotation() == {sims[0].address, sims[1].address}, 15)
        async with Load(gw.url, workers=4) as load:
            await until(lambda: [s.served() for s in sims[:2]], ok=all, what="both served")
            # an agent dies without withdrawing: its member leaves within the TTL
            agents[1].popen.kill()
            t0 = time.monotonic()
            await until(lambda: rotation() == {sims[0].address}, 10, interval=0.05)
            took = time.monotonic() - t0
            assert took <= TTL + 0.6, took  # TTL + one poll + scheduling slack
            # a new member joins without a restart
            agents.append(agent(tmp_path, redis_server, sims[2]))
            await until(lambda: sims[2].address in rotation(), 10)
            # Redis goes down: the last members keep serving
            redis_server.stop()
            await until(lambda: gw.backends()["backends"]["llm"]["registry"]["up"] is False)
            mark = time.monotonic()
            await asyncio.sleep(TTL + 0.5)  # longer than the TTL: nothing judged stale meanwhile
            assert rotation() == {sims[0].address, sims[2].address}
            await until(lambda: load.ok(since=mark) >= 10, 30)
        assert not load.failures()  # the agent's death never reached a client
        assert load.ok(since=mark) > 10
        assert load.ok(since=t0) > 0
        assert "sluice_registry_up" in gw.metrics()
    finally:
        for a in agents:
            a.stop()
        gw.stop()
        for s in sims:
            s.proc.stop()
