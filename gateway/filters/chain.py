"""The chain runs filters in policy order; `on_response` runs in reverse for those that ran.

It is split per phase at build time: a filter without a hook is not called in that phase, and
plain (non-coroutine) hooks are called without an await. A plain `on_request` may return an
awaitable instead of a Status when, for this one request, it must wait (the rate limiter's
yellow queue, a `strict` Redis decision): the chain awaits it; the common path stays plain.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from gateway.core.body import RequestBody
from gateway.filters.base import Filter, RequestContext, Status, StreamEvent

log = logging.getLogger("sluice.chain")


def _hook(f: Filter, name: str) -> tuple[Any, bool] | None:
    fn = getattr(f, name, None)
    if fn is None:
        return None
    return fn, inspect.iscoroutinefunction(fn)


class Chain:
    __slots__ = (
        "filters", "_req", "_body", "_event", "_resp", "_async_req", "has_body", "has_events",
    )  # fmt: skip

    def __init__(self, filters: Sequence[Filter]) -> None:
        self.filters = tuple(filters)
        # (position, hook, is_coroutine) per phase; position = index in `filters`.
        req = [(i, h) for i, f in enumerate(self.filters) if (h := _hook(f, "on_request"))]
        self._req = tuple((i, fn, co) for i, (fn, co) in req)
        self._async_req = any(co for _, _, co in self._req)
        self._body = tuple(f.on_body for f in self.filters if hasattr(f, "on_body"))
        self._event = tuple(f.on_event for f in self.filters if hasattr(f, "on_event"))
        resp = [(i, h) for i, f in enumerate(self.filters) if (h := _hook(f, "on_response"))]
        self._resp = tuple((i, fn, co, self.filters[i].name) for i, (fn, co) in reversed(resp))
        self.has_body = bool(self._body)
        self.has_events = bool(self._event)

    async def on_request(self, ctx: RequestContext) -> Status:
        n = len(self.filters)
        for i, fn, co in self._req:
            ctx.ran = i + 1
            status = (await fn(ctx)) if co else fn(ctx)
            if status is Status.STOP:
                return Status.STOP
            if status is not Status.CONTINUE and await status is Status.STOP:
                return Status.STOP  # a plain hook that must wait this time returned an awaitable
        ctx.ran = n
        return Status.CONTINUE

    def on_body(self, ctx: RequestContext, body: RequestBody) -> Status:
        for fn in self._body:
            if fn(ctx, body) is Status.STOP:
                return Status.STOP
        return Status.CONTINUE

    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        for fn in self._event:
            if fn(ctx, event) is Status.STOP:
                return Status.STOP
        return Status.CONTINUE

    async def on_response(self, ctx: RequestContext) -> None:
        ran = ctx.ran  # on_request never ran: nothing to unwind
        for i, fn, co, name in self._resp:
            if i >= ran:
                continue
            try:
                if co:
                    await fn(ctx)
                else:
                    fn(ctx)
            except Exception:  # one filter's bug must not hide the others' bookkeeping
                log.exception("filter %s on_response failed", name)

    def activate(self) -> None:
        for f in self.filters:
            fn = getattr(f, "activate", None)
            if fn is not None:
                fn()
