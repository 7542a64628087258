"""Composition root: builds the services (once), the policy holder, the chain per policy, and
the upstream pools.

No I/O at import. `Gateway` is what the engines are handed: the active `Snapshot` (policy +
chain), the long-lived `Services`, the upstream pools, and the in-flight tracker the drain waits
on. After every successful reload it activates the new chain and hands the pools their new
limits; the pools never look at the policy themselves.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.core.request import RequestInfo
from gateway.filters.registry import build_chain
from gateway.fleet.store import configure_fleet
from gateway.forward.inflight import InFlight
from gateway.policy.compiled import CompiledPolicy
from gateway.registry.pool import BACKENDS
from gateway.reload.holder import PolicyHolder
from gateway.reload.staging import ROLLOUT, RolloutView
from gateway.reload.traffic import TRAFFIC, TrafficBook
from gateway.services import Services
from gateway.snapshot import Snapshot, snapshot_for

if TYPE_CHECKING:
    from gateway.reload.rollout import ShadowHook
    from gateway.upstream.channels import ChannelPool
    from gateway.upstream.pool import UpstreamPool

log = logging.getLogger("sluice.upstream")

# How often the gRPC channels no policy in use names are closed, besides after each reload:
# members a registry found leave between reloads, and each left channel would keep trying to
# reconnect to an address that is gone.
PRUNE_S = 30.0


class Gateway:
    """Owns the services, the policy holder and the upstream pools; the server owns the
    listeners."""

    def __init__(self, policy_path: Path, services: Services | None = None) -> None:
        self.services = services if services is not None else Services()
        self.holder: PolicyHolder[Snapshot] = PolicyHolder(policy_path, self._build)
        self.traffic = self.services.get(TRAFFIC, TrafficBook)
        self.holder.traffic = self.traffic.snapshot
        self.services.get(ROLLOUT, lambda: RolloutView(self.holder))  # /admin/state section
        self.holder.shadow_hooks = _shadow_hooks
        self._live: list[Snapshot] = []  # snapshots whose chain was activated (the last few)
        self.holder.on_swap(self._activate)
        self.holder.on_candidate(self._activate_once)
        self._activate_once(self.holder.active)
        self.traffic.configure(self.holder.compiled)
        self.inflight = InFlight()
        self.ready = False
        self.draining = False
        self._http_pool: UpstreamPool | None = None
        self._channels: ChannelPool | None = None

    def _build(self, policy: CompiledPolicy) -> Snapshot:
        return Snapshot(policy, build_chain(policy, self.services))

    def _activate(self) -> None:
        snap = self.holder.active
        live = self._live
        if live and live[-1] is not snap and any(s is snap for s in live):
            # Back to a chain that was live before (a rollout rolled back or aborted): owners
            # configured at activation (JWKS sources, tracing, the backends in use) followed the
            # candidate's sections while it served; they take this chain's again.
            configure_fleet(snap.policy.policy, self.services)
            snap.chain.activate()
            self._live = [*(s for s in live if s is not snap), snap]
        else:
            self._activate_once(snap)
        self.traffic.configure(self.holder.compiled)
        p = snap.policy.policy
        if self._http_pool is not None:
            self._http_pool.configure(p.limits, p.timeouts.upstream_idle_s)
        if self._channels is not None:
            self._channels.configure(p.limits)

    def _activate_once(self, snap: Snapshot) -> None:
        """`activate()` each chain once, when it first takes requests (a rollout's candidate
        goes live before it becomes the stable policy)."""
        if any(s is snap for s in self._live):
            return
        # Counted live before its owners are configured: if one of them fails, the holder
        # swaps the previous snapshot back and `_activate` configures them for it again.
        self._live = [*self._live[-3:], snap]
        configure_fleet(snap.policy.policy, self.services)
        snap.chain.activate()

    @property
    def active(self) -> Snapshot:
        """The stable snapshot. Per request use `snapshot_for`, which knows about rollouts."""
        return self.holder.active

    def snapshot_for(self, info: RequestInfo) -> Snapshot:
        """The snapshot a new request is served by (`gateway.snapshot.snapshot_for`, which the
        request path calls itself)."""
        return snapshot_for(self.holder, info)

    @property
    def http_pool(self) -> UpstreamPool:
        if self._http_pool is None:
            from gateway.upstream.pool import UpstreamPool

            p = self.active.policy.policy
            self._http_pool = UpstreamPool(p.limits, p.timeouts.upstream_idle_s)
        return self._http_pool

    @property
    def channels(self) -> ChannelPool:
        """The gRPC channel pool, opened at the first gRPC call; from then on its channels
        are pruned every `PRUNE_S` seconds too (`prune_channels`)."""
        if self._channels is None:
            from gateway.upstream.channels import ChannelPool

            self._channels = ChannelPool(self.active.policy.policy.limits)
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # a tool without a loop: nothing runs in the background
                return self._channels
            self.services.spawn(self._prune_every(), "upstreams:prune")
        return self._channels

    def upstream_state(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The open upstreams by protocol, then member address: HTTP connections (open, idle,
        waiting) and gRPC channel states, for the status page. Reading it never opens a pool
        the traffic never needed."""
        return {
            "http": self._http_pool.state() if self._http_pool is not None else {},
            "grpc": self._channels.state() if self._channels is not None else {},
        }

    async def prune_channels(self, grace: float | None = None) -> int:
        """Close the gRPC channels no policy in use names (after a reload, and every
        `PRUNE_S`): static members of the active policy and of a rollout's candidate, and the
        members the backends' registries found are kept."""
        if self._channels is None:
            return 0
        compiled = self.active.policy
        live = [compiled]
        if self.holder.rollout is not None:  # the candidate of a rollout keeps its channels
            live.append(self.holder.rollout.candidate_policy)
        wanted = {
            e.upstream_key
            for c in live
            for r in c.routes
            for e in r.endpoints
            if e.protocol == "grpc"
        }
        pool = self.services.peek(BACKENDS)
        if pool is not None:  # members discovered from the registry are in use too
            wanted |= pool.upstream_keys("grpc")
        if grace is None:
            grace = compiled.policy.timeouts.drain_s
        return await self._channels.prune(wanted, grace)

    async def _prune_every(self) -> None:
        while not self.services.closed:
            await asyncio.sleep(PRUNE_S)
            try:
                await self.prune_channels()
            except Exception:  # a bug in pruning must not stop the next one
                log.exception("pruning the gRPC channels failed")

    async def aclose(self) -> None:
        try:
            if self._http_pool is not None:
                await self._http_pool.aclose()
            if self._channels is not None:
                await self._channels.aclose()
        finally:  # the owners close (and their background work stops) whatever failed above
            await self.services.aclose()


def _shadow_hooks(snap: Snapshot) -> list[ShadowHook]:
    """The `shadow_request` hooks of a chain's filters (see gateway/reload/rollout.py)."""
    return [f.shadow_request for f in snap.chain.filters if hasattr(f, "shadow_request")]
