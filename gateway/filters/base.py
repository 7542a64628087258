"""Filter protocol and the per-request context that flows through the chain.

A filter's `on_request` returns CONTINUE or STOP; on STOP it has set `ctx.verdict` and the adapter
answers at once. `on_response` runs in reverse order for every filter whose `on_request` ran,
after the response (or the failure) is known: status, bytes and timing are in the context then.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway.core.request import RequestInfo
from gateway.core.verdict import ALLOW, Verdict

if TYPE_CHECKING:
    from gateway.policy.compiled import CompiledPolicy, CompiledRoute, Endpoint


class Status(enum.Enum):
    CONTINUE = enum.auto()
    STOP = enum.auto()  # ctx.verdict is set; adapters respond now


@dataclass(slots=True)
class RequestContext:
    """Mutable state of one request. `policy` is the snapshot the request started with: a reload
    in the middle of the request does not change what it sees."""

    info: RequestInfo
    policy: CompiledPolicy
    request_id: str = ""
    verdict: Verdict = ALLOW
    route: CompiledRoute | None = None
    endpoint: Endpoint | None = None
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    # Filled by the adapter as the response goes out.
    http_status: int = 0
    grpc_status: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    error: str = ""  # short machine-readable cause of a failure ("upstream_timeout", ...)
    cancelled: bool = False
    # Headers/metadata filters add to the upstream request (lower-case names).
    upstream_headers: dict[str, str] = field(default_factory=dict)
    # Free slots for later filters (auth claims, token reservations, spans, ...).
    attrs: dict[str, Any] = field(default_factory=dict)

    def stop(self, verdict: Verdict) -> Status:
        self.verdict = verdict
        return Status.STOP

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


class Filter(Protocol):
    name: str

    async def on_request(self, ctx: RequestContext) -> Status: ...

    async def on_response(self, ctx: RequestContext) -> None: ...
