"""Backends during a staged policy rollout: each side is served from its own view (its own
members) over the same member state; after an abort the stable policy is the latest again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.core.breaker import State
from gateway.policy.model import Rollout as RolloutSpec
from gateway.registry.pool import BACKENDS
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


async def test_each_side_of_a_rollout_keeps_its_own_members(
    server: tuple[Server, Path, dict[str, int]],
) -> None:
    srv, path, ports = server
    x, y = f"127.0.0.1:{ports['x']}", f"127.0.0.1:{ports['y']}"
    pool = srv.gateway.services.peek(BACKENDS)
    bx = pool.latest["pool"].members[x].breaker
    now = pool.clock.now()
    for _ in range(5):
        bx.record(bx.allow(now), now, True, False)
    assert bx.state is State.OPEN
    # the candidate drops member y; while it serves, its section applies
    path.write_text(POLICY.format(http=ports["http"], endpoints=f'{{address: "{x}"}}'))
    result = srv.gateway.holder.reload(rollout=RolloutSpec(stages=[10, 100], hold_s=3600))
    assert result.ok and srv.gateway.holder.rollout is not None
    stable = srv.gateway.holder.active.policy
    candidate = srv.gateway.holder.rollout.candidate_policy
    # each side is served from its own view: the stable one still has y
    assert set(pool.view(stable.backends["pool"]).members) == {x, y}
    assert set(pool.view(candidate.backends["pool"]).members) == {x}
    assert pool.view(candidate.backends["pool"]).members[x].breaker is bx  # shared state
    srv.gateway.holder.abort()
    assert srv.gateway.holder.rollout is None
    assert set(pool.latest["pool"].members) == {x, y}  # the stable policy is the latest again
    assert pool.latest["pool"].members[x].breaker is bx and bx.state is State.OPEN
