"""(compiled) The chain runs filters in policy order; `on_response` runs in reverse for those that
ran.

It is split per phase at build time: a filter without a hook is not called in that phase, and
plain (non-coroutine) hooks are called without an await.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, Final

from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core.body import RequestBody
from gateway.filters.base import Filter

log: Final = logging.getLogger("sluice.chain")
# What a filter's on_event reads unless it says (`event_kinds`).
ALL_KINDS: Final = frozenset(EventKind)


def _hook(f: Filter, name: str) -> tuple[Any, bool] | None:
    fn = getattr(f, name, None)
    if fn is None:
        return None
    return fn, inspect.iscoroutinefunction(fn)


class Chain:
    __slots__ = (
        "filters", "_req", "_body", "_event", "_resp", "has_body", "has_events", "events_always",
        "sync_request", "sync_response", "heard", "hears_head", "hears_json", "body_when_empty",
    )  # fmt: skip

    def __init__(self, filters: Sequence[Filter]) -> None:
        self.filters = tuple(filters)
        # (position, hook, is_coroutine) per phase; position = index in `filters`.
        req = [(i, h) for i, f in enumerate(self.filters) if (h := _hook(f, "on_request"))]
        self._req = tuple((i, fn, co) for i, (fn, co) in req)
        self.sync_request = not any(co for _, _, co in self._req)
        self._body = tuple(f.on_body for f in self.filters if hasattr(f, "on_body"))
        # Per event kind, the on_event hooks of the filters that read it (`event_kinds`).
        listeners = [f for f in self.filters if hasattr(f, "on_event")]
        reads = [(f.on_event, getattr(f, "event_kinds", ALL_KINDS)) for f in listeners]
        hooks: dict[EventKind, tuple[Any, ...]] = {
            kind: tuple(fn for fn, kinds in reads if kind in kinds) for kind in EventKind
        }
        # By the kind's id: an enum's hash is a Python-level call, and this is per event.
        self._event = {id(kind): fns for kind, fns in hooks.items()}
        self.heard = frozenset([kind for kind in hooks if hooks[kind]])
        self.hears_head = EventKind.HEAD in self.heard  # (read per answer: no hash then)
        self.hears_json = EventKind.JSON in self.heard
        resp = [(i, h) for i, f in enumerate(self.filters) if (h := _hook(f, "on_response"))]
        self._resp = tuple((i, fn, co, self.filters[i].name) for i, (fn, co) in resp[::-1])
        self.sync_response = not any(co for _, _, co, _ in self._resp)
        self.has_body = bool(self._body)
        # Whether a request without a body is shown to on_body (a filter says `body_when_empty
        # = False` when its on_body does nothing for one).
        self.body_when_empty = any(
            getattr(f, "body_when_empty", True) for f in self.filters if hasattr(f, "on_body")
        )
        self.has_events = bool(listeners)
        # A filter with `events_when_asked` sets `ctx.wants_events` for the requests whose
        # answer it must see; any other filter with on_event sees every answer.
        self.events_always = any(
            hasattr(f, "on_event") and not getattr(f, "events_when_asked", False)
            for f in self.filters
        )

    async def on_request(self, ctx: RequestContext) -> Status:
        r = self.run_request(ctx)
        return r if r.__class__ is Status else await r  # type: ignore[misc]

    def run_request(self, ctx: RequestContext) -> Status | Awaitable[Status]:
        """The request phase without an await as long as every hook answers plainly: a hook may
        return a Status, or an awaitable (a coroutine hook, or a plain one that must wait this
        time, e.g. for a key fetch); from the first awaitable on, the rest runs in a coroutine
        that the caller awaits."""
        req = self._req
        for pos, (i, fn, _) in enumerate(req):
            ctx.ran = i + 1
            r = fn(ctx)
            if r is Status.CONTINUE:
                continue
            if r is Status.STOP:
                return Status.STOP
            return self._resume(ctx, r, pos + 1)
        ctx.ran = len(self.filters)
        return Status.CONTINUE

    async def _resume(self, ctx: RequestContext, pending: Awaitable[Status], pos: int) -> Status:
        if await pending is Status.STOP:
            return Status.STOP
        for i, fn, _ in self._req[pos:]:
            ctx.ran = i + 1
            r = fn(ctx)
            if r.__class__ is not Status:
                r = await r
            if r is Status.STOP:
                return Status.STOP
        ctx.ran = len(self.filters)
        return Status.CONTINUE

    def on_body(self, ctx: RequestContext, body: RequestBody) -> Status:
        for fn in self._body:
            if fn(ctx, body) is Status.STOP:
                return Status.STOP
        return Status.CONTINUE

    def listens(self, ctx: RequestContext) -> bool:
        """Whether this request's response phase is shown to on_event (and parsed for it)."""
        return self.events_always or (self.has_events and ctx.wants_events)

    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        """The event to the filters that read its kind (an event of a kind no filter reads, see
        `heard`, need not be made at all)."""
        for fn in self._event[id(event.kind)]:
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

    def on_response_plain(self, ctx: RequestContext) -> None:
        """`on_response` without an await, for a chain whose response hooks are all plain."""
        ran = ctx.ran
        for i, fn, _, name in self._resp:
            if i >= ran:
                continue
            try:
                fn(ctx)
            except Exception:
                log.exception("filter %s on_response failed", name)

    def activate(self) -> None:
        for f in self.filters:
            fn = getattr(f, "activate", None)
            if fn is not None:
                fn()
