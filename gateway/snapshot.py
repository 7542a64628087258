"""(compiled) `Snapshot`: what one request sees from arrival to end, a compiled policy and the
chain built for it. The policy holder swaps snapshots atomically; a request keeps the one it
started with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.filters.chain import Chain

if TYPE_CHECKING:
    from gateway.core.request import RequestInfo
    from gateway.policy.base import Limits, Timeouts
    from gateway.policy.compiled import CompiledPolicy
    from gateway.reload.holder import PolicyHolder


class Bounds:
    """The policy's limits and timeouts every request reads, copied out of the policy model
    when the snapshot is built: each is then a native attribute read on the request path (a
    model's field is a generic attribute lookup)."""

    __slots__ = (
        "max_header_bytes", "max_header_count", "max_body_bytes", "max_buffered_body_bytes",
        "max_streamed_uploads_per_backend", "max_event_bytes", "body_read_s",
    )  # fmt: skip

    def __init__(self, limits: Limits, timeouts: Timeouts) -> None:
        self.max_header_bytes: int = limits.max_header_bytes
        self.max_header_count: int = limits.max_header_count
        self.max_body_bytes: int = limits.max_body_bytes
        self.max_buffered_body_bytes: int = limits.max_buffered_body_bytes
        self.max_streamed_uploads_per_backend: int = limits.max_streamed_uploads_per_backend
        self.max_event_bytes: int = limits.max_event_bytes
        self.body_read_s: float = timeouts.body_read_s


class Snapshot:
    """A compiled policy, its chain and its `Bounds`; set once, never changed."""

    __slots__ = ("policy", "chain", "bounds")

    def __init__(self, policy: CompiledPolicy, chain: Chain) -> None:
        self.policy = policy
        self.chain = chain
        p = policy.policy
        self.bounds = Bounds(p.limits, p.timeouts)


def snapshot_for(holder: PolicyHolder[Snapshot], info: RequestInfo) -> Snapshot:
    """The snapshot a new request is served by, chosen once at arrival: the stable one, or
    during a staged rollout the side `RolloutController.choose` picks (by a hash of the
    request's x-request-id; see gateway/reload/rollout.py)."""
    ro = holder.rollout
    return holder.active if ro is None else ro.choose(info)
