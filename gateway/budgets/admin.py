"""The admin listener's budget endpoints (`sluice budget` calls them):

GET  /admin/budgets/{rule}/{key}                  one key's budget in the current period
POST /admin/budgets/{rule}/{key}/grant?tokens=N   N tokens more for this period
POST /admin/budgets/{rule}/{key}/reset            the period's tally back to zero

The key is URL-encoded as `sluice budget show` prints it (parts joined with "|"). Changes are
for loopback peers only and each is written to the `sluice.audit` log. With a store they act on
the shared tally at once (every replica sees it at its next sync); without one, on this
process's tally.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.budgets.owner import BUDGETS
from gateway.errors import StoreUnavailable
from gateway.services import Services

MAX_GRANT = 10**15


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, indent=2), status=status, content_type="application/json"
    )


def _error(kind: str, message: str, status: int) -> web.Response:
    return _json({"error": {"type": kind, "message": message}}, status)


def add_routes(
    app: web.Application, services: Services, loopback: Callable[[web.Request], bool]
) -> None:
    async def handle(request: web.Request) -> web.Response:
        action = request.match_info.get("action", "show")
        if action != "show" and not loopback(request):
            return _error("forbidden", "loopback only", 403)
        book = services.peek(BUDGETS)
        if book is None or not book.by_name:
            return _error("not_found", "no budgets in the running policy", 404)
        tokens = 0
        if action == "grant":
            try:
                tokens = int(request.query.get("tokens", ""))
                if not 0 < tokens <= MAX_GRANT:
                    raise ValueError
            except ValueError:
                return _error("bad_request", "tokens: a positive integer", 400)
        rule, key = request.match_info["rule"], request.match_info["key"]
        try:
            doc = await book.figures(rule, key, action, tokens)
        except KeyError as e:
            return _error("not_found", str(e.args[0]), 404)
        except StoreUnavailable as e:
            return _error("store_unavailable", f"the budget store does not answer: {e}", 503)
        return _json(doc)

    app.router.add_get("/admin/budgets/{rule}/{key}", handle)
    app.router.add_post(r"/admin/budgets/{rule}/{key}/{action:grant|reset}", handle)
