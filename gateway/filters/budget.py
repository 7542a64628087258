"""(compiled) Token budgets on the request path. Decisions are `gateway.core.budgets`'; state is the
services' `gateway.budgets.owner.Book`.

- `on_request` (after auth: budgets are keyed by claims), with a shared store: each rule's key
  and its ledger for the current period, and a hold of the request's likely size (prompt ≤ body
  bytes / 4, `default_max_tokens` of output) on the local share, so that requests arriving
  together see each other. Plain, except when the local share cannot cover the hold: then it
  waits for the sync loop to lease more, at most `wait_ms`. Without a store there is nothing to
  wait for, so nothing is held: the body phase keys the request and reserves (the same
  decisions, one reservation instead of a hold and an adjustment).
- `on_body` (HTTP): the hold makes way for the reservation, `cost(model, prompt estimate,
  max_tokens)` per rule, taken from the local share, or the request is refused (429; 503 when
  the store is unreachable and the rule fails closed). A stream is asked for its usage chunk
  if the client did not ask.
- `on_event`: the completion tokens of each SSE chunk (for a stream that ends without usage).
- `on_response`: the reservation settled to the backend's usage (weighted), the rest given
  back; the warn_at fractions passed are logged and counted.

A budget counts HTTP requests with a body (the LLM APIs); gRPC calls and bodiless requests
reserve nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import ClassVar, Final

from gateway.budgets.compiled import CompiledBudgets, compile_budgets
from gateway.budgets.entries import Entry, RuleBook
from gateway.budgets.owner import Book, book_for, iso
from gateway.budgets.verdicts import exhausted, store_down
from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core.body import RequestBody
from gateway.core.budgets import level
from gateway.core.outcome import Outcome
from gateway.core.request import Wire, first_route
from gateway.core.tokens import chunk_tokens
from gateway.policy.compiled import CompiledPolicy
from gateway.services import Services
from gateway.telemetry import metrics

NAME: Final = "budget"
_CONTINUE: Final = Status.CONTINUE
_GRPC: Final = Wire.GRPC
_BODILESS: Final = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
WARNING_HEADER: Final = "x-sluice-budget-warning"


class Item:
    """One rule's hold on one request."""

    __slots__ = ("rb", "e", "amount", "epoch")

    def __init__(self, rb: RuleBook, e: Entry) -> None:
        self.rb = rb
        self.e = e
        self.amount = -1  # reserved tokens (-1: nothing reserved)
        self.epoch = 0


class Ticket:
    __slots__ = ("items", "model", "prompt", "streamed", "exact")

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.exact = False  # the body phase reserved the exact amounts
        self.model: str | None = None
        self.prompt = 0
        self.streamed = 0


class BudgetFilter:
    name = "budget"  # NAME
    events_when_asked = True  # only a request that reserved reads its answer
    event_kinds: ClassVar[frozenset[EventKind]] = frozenset({EventKind.SSE})
    body_when_empty = False

    def __init__(self, c: CompiledBudgets, book: Book) -> None:
        self.c = c
        self.book = book
        self.books = tuple(book.book(r) for r in c.rules)
        self.default_max = c.section.default_max_tokens
        self.needs_route = c.needs_route
        self.wall = book.wall

    def activate(self) -> None:
        self.book.activate(self.c)

    # -- request phase ------------------------------------------------------------------------
    def on_request(self, ctx: RequestContext) -> Status | Awaitable[Status]:
        book = self.book
        if book.store is None:
            return _CONTINUE  # nothing to wait for: the body phase keys and reserves at once
        info = ctx.info
        if info.method in _BODILESS or info.protocol is _GRPC:
            return _CONTINUE  # nothing to reserve: no prompt, no completion
        items = self._items(ctx)
        waits: list[tuple[Item, int]] | None = None
        cl = info.content_length
        prompt = (cl + 3) // 4 if cl else 0  # the prompt is at most its body bytes / 4
        for item in items:
            # Held until the body phase knows the exact amount: what the request will likely
            # need, so that requests arriving together see each other (and wait together for
            # the sync loop to lease more).
            hint = item.rb.rule.cost.of(None, prompt, self.default_max)
            lg = item.e.ledger
            if hint <= lg.avail:
                lg.avail -= hint
                lg.reserved += hint
                item.amount, item.epoch = hint, lg.epoch
            elif not book.down:
                if waits is None:
                    waits = []
                waits.append((item, hint))
        ctx.budget = Ticket(items)
        if waits is not None:
            return self._wait(waits)
        return _CONTINUE

    def _items(self, ctx: RequestContext) -> list[Item]:
        """Each rule's entry for this request's key in the current period."""
        info = ctx.info
        book = self.book
        p = ctx.principal
        claims = p.claims if p is not None else None
        route = None
        if self.needs_route:
            r = ctx.route or first_route(ctx.policy.routes, info)
            route = r.name if r is not None else None
        now = self.wall()
        items = []
        for rb in self.books:
            rule = rb.rule
            k = rule.key(info, claims, route, None)
            e = rb.entries.get(k)
            if e is None or now >= e.ledger.window.end or rule.dynamic:
                e = book.entry(rb, k, rule.limit(k, claims, info.headers), now)
            else:
                rb.entries.move_to_end(k)
            items.append(Item(rb, e))
        return items

    async def _wait(self, waits: list[tuple[Item, int]]) -> Status:
        deadline = self.book.deadline()  # one wait_ms for the request, whatever its rules
        for item, need in waits:  # one sync round answers them all: the later waits are short
            if await self.book.lease(item.e, need, deadline):
                item.amount, item.epoch = need, item.e.ledger.epoch
        return Status.CONTINUE

    # -- body phase ---------------------------------------------------------------------------
    def on_body(self, ctx: RequestContext, body: RequestBody) -> Status:
        if not body.size:
            return Status.CONTINUE  # (a hold of the request phase is released at its end)
        t = ctx.budget
        book = self.book
        if not isinstance(t, Ticket):
            info = ctx.info
            if book.store is not None or info.method in _BODILESS or info.protocol is _GRPC:
                return Status.CONTINUE
            t = ctx.budget = Ticket(self._items(ctx))  # no store: keyed here, not held before
        shared = book.store is not None
        prompt = body.prompt_tokens_estimate
        out = body.max_tokens if body.max_tokens is not None else self.default_max
        t.model, t.prompt = body.model, prompt
        t.exact = True
        warnings = ""
        for item in t.items:
            rb, e = item.rb, item.e
            rule = rb.rule
            lg = e.ledger
            amount = rule.cost.of(body.model, prompt, out)
            held = item.amount
            if held >= 0 and item.epoch == lg.epoch and amount - held <= lg.avail:
                lg.avail -= amount - held  # the hold becomes the exact amount
                lg.reserved += amount - held
                item.amount = amount
                if shared:
                    book.used(e)
                if rule.warn_at:
                    warnings = self._warning(rb, e, warnings)
                continue
            if held >= 0:  # the request phase's hold makes way for the exact amount
                lg.release(held, item.epoch)
                item.amount = -1
            if not lg.reserve(amount):
                down = book.store is not None and book.down
                if down and rule.closed and rule.enforce:
                    return self._refuse(ctx, t, item, amount, "store_down", body.api)
                if not down and rule.enforce:
                    return self._refuse(ctx, t, item, amount, "exhausted", body.api)
                if not down:
                    rb.counts["shadow_refused"] += 1
                    metrics.BUDGET_REFUSED.labels(rule.name, "shadow_exhausted").inc()
                else:
                    rb.counts["admitted_store_down"] += 1
                lg.reserve(amount, overdraft=True)
            item.amount = amount
            item.epoch = lg.epoch
            if shared:
                book.used(e)
            if rule.warn_at:
                warnings = self._warning(rb, e, warnings)
        if warnings:
            ctx.response_headers.append((WARNING_HEADER, warnings))
            ctx.budget_warning = warnings
        ctx.wants_events = True  # settled from the answer's usage: parse it
        if body.stream and body.parsed and not body.wants_usage:
            body.set("stream_options", {**(body.stream_options or {}), "include_usage": True})
            body.usage_added = True
        return Status.CONTINUE

    def _warning(self, rb: RuleBook, e: Entry, warnings: str) -> str:
        lg = e.ledger
        hit = level(lg.limit + lg.grant, self.book.spent(e), rb.rule.warn_at)
        if hit is None:
            return warnings
        return f"{warnings}{', ' if warnings else ''}{rb.rule.name}={hit:g}"

    def _refuse(
        self, ctx: RequestContext, t: Ticket, item: Item, amount: int, why: str, api: str
    ) -> Status:
        book = self.book
        for other in t.items:  # what the earlier rules reserved goes back
            if other.amount >= 0:
                other.e.ledger.release(other.amount, other.epoch)
                other.amount = -1
        rule = item.rb.rule
        lg = item.e.ledger
        item.rb.counts[why] += 1
        metrics.BUDGET_REFUSED.labels(rule.name, why).inc()
        left = max(0, lg.limit + lg.grant - book.spent(item.e))
        resets = iso(lg.window.end)
        ctx.decide(NAME, "reject", f"{rule.name}:{why}")
        if why == "store_down":
            return ctx.stop(store_down(rule.name, left, resets, api))
        # Left for the period, but not in this replica's share now (the others hold it): soon.
        retry = 1.0 if left >= amount else lg.window.end - book.wall()
        return ctx.stop(exhausted(rule.name, left, amount, resets, retry, api))

    # -- response phase -----------------------------------------------------------------------
    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        t = ctx.budget
        if isinstance(t, Ticket):
            t.streamed += chunk_tokens(event.doc)
        return Status.CONTINUE

    def on_response(self, ctx: RequestContext) -> None:
        t = ctx.budget
        if not isinstance(t, Ticket):
            return
        ctx.budget = None
        book = self.book
        shared = book.store is not None
        usage = ctx.usage
        exact = t.exact
        for item in t.items:
            held = item.amount
            if held < 0:
                continue
            rb, e = item.rb, item.e
            lg = e.ledger
            if not exact:  # held in the request phase, no body phase came: nothing to charge
                lg.release(held, item.epoch)
                if shared:
                    book.used(e)
                continue
            cost = rb.rule.cost
            if usage is not None:
                used = cost.of(t.model, usage.prompt_tokens, usage.completion_tokens)
            elif t.streamed:
                used = cost.of(t.model, t.prompt, t.streamed)
            elif ctx.outcome is not Outcome.OK and ctx.first_byte_at is None:
                used = 0  # refused later, or the backend never answered: nothing was served
            else:
                used = held  # served, usage unknown: the reservation stands
            warn = rb.rule.warn_at
            before = book.spent(e) - lg.reserved if warn else 0
            if item.epoch == lg.epoch:  # (Ledger.settle, inline: once per request and rule)
                lg.reserved -= held
                lg.avail += held - used
                if lg.avail + lg.reserved < 0:
                    lg.avail = -lg.reserved
                lg.used += used
                lg.unreported += used
            else:
                lg.settle(held, used, item.epoch)
            if used:
                rb.tokens.inc(used)
            if warn:
                book.warn(rb, e, before, book.spent(e) - lg.reserved)
            if shared:
                book.used(e)


def build(section: CompiledPolicy, services: Services) -> BudgetFilter | None:
    p = section.policy
    b = p.budgets
    if b is None or not b.rules:
        return None
    return BudgetFilter(compile_budgets(b), book_for(services))
