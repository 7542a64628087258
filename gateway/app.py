"""Composition root: builds the services (once), the policy holder, the chain per policy, and
the upstream pools.

No I/O at import. `Gateway` is what adapters are handed: the active `Snapshot` (policy + chain),
the long-lived `Services`, the upstream pools, and the in-flight tracker the drain waits on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.filters.base import RequestContext
from gateway.filters.registry import build_chain
from gateway.policy.compiled import CompiledPolicy
from gateway.policy.holder import PolicyHolder
from gateway.services import Services
from gateway.snapshot import Snapshot
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.adapters.channels import ChannelPool
    from gateway.adapters.pool import UpstreamPool


class InFlight:
    """Counts requests being served; the drain waits for zero."""

    __slots__ = ("count", "_idle")

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count <= 0:
            self.count = 0
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


class Gateway:
    """Owns the policy holder and the upstream pools; the server owns the listeners."""

    def __init__(self, policy_path: Path, services: Services | None = None) -> None:
        self.services = services if services is not None else Services()
        self.holder: PolicyHolder[Snapshot] = PolicyHolder(policy_path, self._build)
        self.holder.on_swap(self._activate)
        self.holder.active.chain.activate()
        self.inflight = InFlight()
        self.ready = False
        self.draining = False
        self._http_pool: UpstreamPool | None = None
        self._channels: ChannelPool | None = None

    def _build(self, policy: CompiledPolicy) -> Snapshot:
        return Snapshot(policy, build_chain(policy, self.services))

    def _activate(self) -> None:
        self.holder.active.chain.activate()

    @property
    def active(self) -> Snapshot:
        return self.holder.active

    @property
    def http_pool(self) -> UpstreamPool:
        if self._http_pool is None:
            from gateway.adapters.pool import UpstreamPool

            self._http_pool = UpstreamPool(self.holder)
        return self._http_pool

    @property
    def channels(self) -> ChannelPool:
        if self._channels is None:
            from gateway.adapters.channels import ChannelPool

            self._channels = ChannelPool(self.holder)
        return self._channels

    async def finish(self, active: Snapshot, ctx: RequestContext) -> None:
        """Run on_response (reverse order) and record the request's metrics. Never raises."""
        await active.chain.on_response(ctx)
        metrics.record_request(ctx)

    async def aclose(self) -> None:
        if self._http_pool is not None:
            await self._http_pool.aclose()
        if self._channels is not None:
            await self._channels.aclose()
        await self.services.aclose()
