"""Routing: first matching route of the request's policy snapshot, then a weighted endpoint."""

from __future__ import annotations

from gateway.core.verdict import NO_ENDPOINT, NO_ROUTE
from gateway.filters.base import RequestContext, Status
from gateway.policy.compiled import CompiledPolicy
from gateway.services import Services


class RouteFilter:
    name = "route"

    def __init__(self, policy: CompiledPolicy) -> None:
        self._policy = policy

    def on_request(self, ctx: RequestContext) -> Status:
        # An earlier filter (auth) may have matched already: the same policy, the same answer.
        route = ctx.route or self._policy.match(ctx.info)
        if route is None:
            return ctx.stop(NO_ROUTE)
        ctx.route = route
        endpoint = route.pick()
        if endpoint is None:
            return ctx.stop(NO_ENDPOINT)
        ctx.endpoint = endpoint
        return Status.CONTINUE


def build(section: CompiledPolicy, services: Services) -> RouteFilter:
    return RouteFilter(section)
