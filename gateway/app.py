"""Composition root: builds the services (once), the policy holder, the chain per policy, and
the upstream pools.

No I/O at import. `Gateway` is what the engines are handed: the active `Snapshot` (policy +
chain), the long-lived `Services`, the upstream pools, and the in-flight tracker the drain waits
on. After every successful reload it activates the new chain and hands the pools their new
limits; the pools never look at the policy themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.core.request import RequestInfo
from gateway.filters.base import RequestContext
from gateway.filters.chain import Chain
from gateway.filters.registry import build_chain
from gateway.policy.compiled import CompiledPolicy
from gateway.policy.holder import PolicyHolder
from gateway.services import Services
from gateway.snapshot import Snapshot
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.upstream.channels import ChannelPool
    from gateway.upstream.pool import UpstreamPool


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
    """Owns the services, the policy holder and the upstream pools; the server owns the
    listeners."""

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
        snap = self.holder.active
        snap.chain.activate()
        p = snap.policy.policy
        if self._http_pool is not None:
            self._http_pool.configure(p.limits, p.timeouts.upstream_idle_s)
        if self._channels is not None:
            self._channels.configure(p.limits)

    @property
    def active(self) -> Snapshot:
        return self.holder.active

    def snapshot_for(self, info: RequestInfo) -> Snapshot:
        """The snapshot a new request is served by (the one place the request path asks)."""
        return self.holder.active

    @property
    def http_pool(self) -> UpstreamPool:
        if self._http_pool is None:
            from gateway.upstream.pool import UpstreamPool

            p = self.active.policy.policy
            self._http_pool = UpstreamPool(p.limits, p.timeouts.upstream_idle_s)
        return self._http_pool

    @property
    def channels(self) -> ChannelPool:
        if self._channels is None:
            from gateway.upstream.channels import ChannelPool

            self._channels = ChannelPool(self.active.policy.policy.limits)
        return self._channels

    async def prune_channels(self, grace: float | None = None) -> int:
        """Close the gRPC channels the active policy no longer uses (after a reload)."""
        if self._channels is None:
            return 0
        compiled = self.active.policy
        wanted = {e.address for r in compiled.routes for e in r.endpoints if e.protocol == "grpc"}
        if grace is None:
            grace = compiled.policy.timeouts.drain_s
        return await self._channels.prune(wanted, grace)

    def finish(self, snap: Snapshot, ctx: RequestContext) -> Awaitable[None] | None:
        """Run on_response (reverse order) and record the request's metrics. Never raises.
        Returns an awaitable only when a filter's on_response is a coroutine (await it)."""
        chain = snap.chain
        if chain.sync_response:
            chain.on_response_plain(ctx)
            metrics.record_request(ctx)
            return None
        return self._finish(chain, ctx)

    async def _finish(self, chain: Chain, ctx: RequestContext) -> None:
        await chain.on_response(ctx)
        metrics.record_request(ctx)

    async def aclose(self) -> None:
        if self._http_pool is not None:
            await self._http_pool.aclose()
        if self._channels is not None:
            await self._channels.aclose()
        await self.services.aclose()
