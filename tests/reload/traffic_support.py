"""Helpers for the guard and rollout tests: policies as text, requests recorded as if served."""

from __future__ import annotations

from gateway.context import RequestContext
from gateway.core.clock import ManualClock
from gateway.core.request import RequestInfo, Wire
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.loader import load_policy_text
from gateway.reload.traffic import TrafficBook

BASE = """\
backends:
  - name: vllm
    endpoints: [{address: "127.0.0.1:9000"}, {address: "127.0.0.1:9001", weight: 2}]
  - name: triton
    protocol: grpc
    endpoints: [{address: "127.0.0.1:9100"}]
routes:
  - name: grpc
    match: {protocol: grpc}
    backend: triton
  - name: openai
    match: {protocol: http, path_prefix: /v1/}
    backend: vllm
"""


def compiled(text: str = BASE) -> CompiledPolicy:
    return compile_policy(load_policy_text(text, "policy.yaml"))


def served(
    policy: CompiledPolicy,
    path: str = "/v1/chat/completions",
    *,
    protocol: Wire = Wire.HTTP,
    body: int = 300,
    first_byte: float = 0.02,
    duration: float = 0.5,
    started: float = 0.0,
    headers: dict[str, str] | None = None,
    status: int = 200,
    answered: bool = True,
) -> RequestContext:
    """A finished request as the forwarding path leaves it (route and endpoint from `policy`)."""
    info = RequestInfo(protocol, "POST", path, headers or {}, "127.0.0.1:5555", "", body)
    ctx = RequestContext(info, policy)
    ctx.started = started
    ctx.route = policy.match(info)
    ctx.endpoint = ctx.route.pick() if ctx.route is not None else None
    ctx.bytes_in = body if answered else 0  # a refused request's body is never read
    ctx.first_byte_at = started + first_byte if answered else None
    ctx.http_status = status
    ctx.grpc_status = 0 if protocol is Wire.GRPC else None
    return ctx


def book_with(
    policy: CompiledPolicy, clock: ManualClock, n: int, duration: float = 0.5, **kw: object
) -> TrafficBook:
    """A book with `n` requests recorded (each finishing `duration` after its start)."""
    book = TrafficBook(clock.now)
    book.configure(policy)
    add(book, policy, clock, n, duration, **kw)
    return book


def add(
    book: TrafficBook,
    policy: CompiledPolicy,
    clock: ManualClock,
    n: int,
    duration: float = 0.5,
    **kw: object,
) -> None:
    for _ in range(n):
        ctx = served(policy, started=clock.t - duration, **kw)  # type: ignore[arg-type]
        book.record(ctx)
