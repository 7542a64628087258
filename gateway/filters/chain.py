"""The chain runs filters in policy order; `on_response` runs in reverse for those that ran."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gateway.filters.base import Filter, RequestContext, Status

log = logging.getLogger("sluice.chain")


class Chain:
    __slots__ = ("filters",)

    def __init__(self, filters: Sequence[Filter]) -> None:
        self.filters = tuple(filters)

    async def on_request(self, ctx: RequestContext) -> Status:
        ran = 0
        try:
            for f in self.filters:
                ran += 1
                if await f.on_request(ctx) is Status.STOP:
                    return Status.STOP
            return Status.CONTINUE
        finally:
            ctx.attrs["_ran"] = ran

    async def on_response(self, ctx: RequestContext) -> None:
        ran = ctx.attrs.get("_ran", 0)  # on_request never ran: nothing to unwind
        for f in reversed(self.filters[:ran]):
            try:
                await f.on_response(ctx)
            except Exception:  # one filter's bug must not hide the others' bookkeeping
                log.exception("filter %s on_response failed", f.name)
