"""`Snapshot`: what one request sees from arrival to end, a compiled policy and the chain built
for it. The policy holder swaps snapshots atomically; a request keeps the one it started with."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.filters.chain import Chain
from gateway.policy.compiled import CompiledPolicy


@dataclass(frozen=True, slots=True)
class Snapshot:
    policy: CompiledPolicy
    chain: Chain
