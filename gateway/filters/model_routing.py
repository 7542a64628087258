"""(compiled) Routing on what an LLM request asks for: the route filter of a policy that has a route
needing the body (`match.model`, `by_model`, `affinity`).

Routes still match in order. An HTTP request whose first matching route (by protocol, path,
methods and headers) needs the body is routed once, in the body phase: the first route that
matches the body's `model` too (`match.model` globs; a request without a model never takes such
a route), then, on a `by_model` route, only the backends and members that serve the model
(`gateway.core.models`), and with `affinity.prefix` the member chosen for the prompt's prefix
with bounded load (`gateway.core.affinity`). Requests whose first matching route does not
need the body are routed as before, when their head arrives. A gRPC call is routed the same
way on the `model_name` its (first) request message names (field 1, read from the raw bytes by
`gateway.core.protowire`; KServe v2 / Triton), before its chain runs: a model nobody serves is
NOT_FOUND. A streaming call's first message is waited for only on a route that needs it, and
for a bounded time (`gateway.forward.grpc.FIRST_MESSAGE_S`); one that has sent none by then is
routed on its head.

Answers of its own: a model no backend of a `by_model` route serves is a 404 with an
OpenAI-style error (`code: model_not_found`); `GET /v1/models` through a `by_model` route
answers the union of what its backends serve, de-duplicated.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Final

from gateway.context import RequestContext, Status
from gateway.core.affinity import prefix_key
from gateway.core.body import RequestBody
from gateway.core.request import Wire, first_route
from gateway.core.verdict import GRPC_NOT_FOUND, GRPC_OK, NO_ENDPOINT, NO_ROUTE, Verdict, answer
from gateway.filters.choice import Choice
from gateway.filters.routing import RouteFilter, RoutePicker
from gateway.filters.routing import build as build_plain
from gateway.registry.pool import BACKENDS, BackendPool

if TYPE_CHECKING:
    from gateway.policy.compiled import CompiledPolicy
    from gateway.services import Services

MODEL_LIST_PATH: Final = "/v1/models"


def model_not_found(model: str) -> Verdict:
    message = f"The model `{model[:256]}` does not exist or is not served here."
    body = {"error": {"message": message, "type": "invalid_request_error", "param": "model",
                      "code": "model_not_found"}}  # fmt: skip
    raw = json.dumps(body, separators=(",", ":")).encode()
    return answer(404, GRPC_NOT_FOUND, "model_not_found", message, raw)


def model_list(picker: RoutePicker) -> Verdict:
    """The union of what the route's backends serve (first backend naming a model owns it)."""
    data: dict[str, dict[str, object]] = {}
    for view in picker.groups:
        mv = view.models
        if mv is None:
            continue
        ix = mv.index()
        for name in sorted(ix.names()):
            if name not in data:
                item: dict[str, object] = {"id": name, "object": "model", "created": 0,
                                           "owned_by": view.name}  # fmt: skip
                parent = ix.parent(name)
                if parent is not None:
                    item["parent"] = parent
                data[name] = item
    raw = json.dumps({"object": "list", "data": list(data.values())}, separators=(",", ":"))
    return answer(200, GRPC_OK, "", "", raw.encode())


class ModelRouteFilter(RouteFilter):
    """The route filter with the body phase (see the module docstring)."""

    def on_request(self, ctx: RequestContext) -> Status:
        info = ctx.info
        if info.protocol is Wire.HTTP:
            route = first_route(self.policy.routes, info, None, by_model=False)
            if route is None:
                return ctx.stop(NO_ROUTE)
            if route.needs_body:
                ctx.route = route  # provisional: the body phase decides
                return Status.CONTINUE
            return super().on_request(ctx)
        b = ctx.body  # gRPC: a unary call's model_name, read by the forwarding path
        if b is None or b.model is None:
            return super().on_request(ctx)
        return self.on_body(ctx, b)

    def on_body(self, ctx: RequestContext, body: RequestBody) -> Status:
        if ctx.endpoint is not None:
            return Status.CONTINUE  # routed at its head
        info = ctx.info
        if info.protocol is Wire.HTTP and (ctx.route is None or not ctx.route.needs_body):
            return Status.CONTINUE
        model = body.model
        route = ctx.route
        if route is None or route.model_re is not None:  # else the head's route is the one
            route = first_route(self.policy.routes, info, model)
        if route is None:
            return ctx.stop(model_not_found(model) if model is not None else NO_ROUTE)
        ctx.route = route
        if not self.pool.started:
            self.pool.start()
        picker = self.pickers[route.name]
        if (
            route.by_model
            and info.method == "GET"
            and route.upstream_path(info.path).rstrip("/") == MODEL_LIST_PATH
        ):
            return ctx.stop(model_list(picker))
        choice = servings = prefix = None
        if route.by_model and model is not None:
            servings = picker.serving(model)
            if servings is None:
                return ctx.stop(model_not_found(model))
        doc = body.doc
        if doc is not None and route.prefix_bytes:
            prefix = prefix_key(doc, route.prefix_bytes)
        if servings is not None or prefix is not None:
            choice = Choice(servings, prefix)
        a = picker.first(ctx, self.now(), choice)
        if a is None:
            return ctx.stop(NO_ENDPOINT)
        ctx.upstream_attempt = a
        ctx.endpoint = a.member.endpoint
        return Status.CONTINUE


def build(section: CompiledPolicy, services: Services) -> RouteFilter:
    """The route filter of a policy: the model-aware one when a route needs the body (its
    `on_body` makes every request's body be read and parsed), else the plain one."""
    if not section.body_routing:
        return build_plain(section, services)
    return ModelRouteFilter(section, services.get(BACKENDS, lambda: BackendPool(services)))
