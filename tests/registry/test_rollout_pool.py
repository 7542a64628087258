"""Backends during a staged policy rollout: the candidate's backends section applies while it
serves; an abort gives the stable policy its members back, with their state kept."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.core.breaker import State
from gateway.policy.model import Rollout as RolloutSpec
from gateway.server import Server
from tests.support import free_port

POLICY = """\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}}}
  grpc: null
  admin: null
access_log: {{enabled: false}}
backends:
  - name: pool
    endpoints: [{endpoints}]
    breaker: {{}}
routes:
  - name: all
    match: {{protocol: http}}
    backend: pool
"""


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[Server, Path, dict[str, int]]]:
    ports = {"http": free_port(), "x": free_port(), "y": free_port()}
    path = tmp_path / "policy.yaml"
    both = f'{{address: "127.0.0.1:{ports["x"]}"}}, {{address: "127.0.0.1:{ports["y"]}"}}'
    path.write_text(POLICY.format(http=ports["http"], endpoints=both))
    srv = Server(path)
    await srv.start()
    try:
        yield srv, path, ports
    finally:
        await srv.drain_and_close()


async def test_abort_gives_the_stable_policy_its_members_back(
    server: tuple[Server, Path, dict[str, int]],
) -> None:
    srv, path, ports = server
    x, y = f"127.0.0.1:{ports['x']}", f"127.0.0.1:{ports['y']}"
    pool = srv.gateway.services.peek("backends")
    st = pool.backends["pool"]
    bx = st.members[x].breaker
    now = pool.clock.now()
    for _ in range(5):
        bx.record(bx.allow(now), now, True, False)
    assert bx.state is State.OPEN
    # the candidate drops member y; while it serves, its section applies
    path.write_text(POLICY.format(http=ports["http"], endpoints=f'{{address: "{x}"}}'))
    result = srv.gateway.holder.reload(rollout=RolloutSpec(stages=[10, 100], hold_s=3600))
    assert result.ok and srv.gateway.holder.rollout is not None
    assert set(st.members) == {x}
    srv.gateway.holder.abort()
    assert srv.gateway.holder.rollout is None
    assert set(st.members) == {x, y}  # the stable policy's members again
    assert st.members[x].breaker is bx and bx.state is State.OPEN  # x kept its state
