"""Routing: first matching route of the request's policy snapshot, then a weighted endpoint."""

from __future__ import annotations

from gateway.core.verdict import GRPC_UNAVAILABLE, NO_ROUTE, reject
from gateway.filters.base import RequestContext, Status
from gateway.policy.compiled import CompiledPolicy

NO_ENDPOINT = reject(503, GRPC_UNAVAILABLE, "no_healthy_upstream", "no backend available", 1.0)


class RouteFilter:
    name = "route"

    def __init__(self, policy: CompiledPolicy) -> None:
        self._policy = policy

    async def on_request(self, ctx: RequestContext) -> Status:
        route = self._policy.match(ctx.info)
        if route is None:
            return ctx.stop(NO_ROUTE)
        ctx.route = route
        endpoint = route.pick()
        if endpoint is None:
            return ctx.stop(NO_ENDPOINT)
        ctx.endpoint = endpoint
        return Status.CONTINUE

    async def on_response(self, ctx: RequestContext) -> None:
        return None
