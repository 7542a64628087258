"""(compiled) The filter contract: the hooks a filter may implement (the per-request context they
get is `gateway.context.RequestContext`).

Phases, in order (every hook is optional; the chain is split per phase when it is built, so a
hook a filter leaves out costs nothing per request):

- `on_request(ctx) -> Status` (plain, or a coroutine when it must await; a plain hook may also
  return an awaitable when, this once, it must wait, e.g. for a key fetch: the chain then awaits
  it and the rest of the phase): headers, peer, path are known. STOP means `ctx.verdict` is set
  and the request is answered now.
- `on_body(ctx, body) -> Status`: the request body (`gateway.core.body.RequestBody`): model,
  max_tokens, stream, prompt size, for JSON bodies up to the policy's cap; sizes only otherwise.
  A filter may rewrite a parsed body (`body.set`). Runs for HTTP requests only, after every
  `on_request`, before the upstream is contacted. STOP rejects as in `on_request`. A filter
  whose on_body does nothing for a request without a body says `body_when_empty = False`; when
  every such filter says so, a request without a body has no body phase (`ctx.body` None).
- `on_event(ctx, event) -> Status`: what comes back: the response head, each SSE event, the
  JSON body of a non-streaming completion (up to a cap), gRPC trailing metadata. STOP ends the
  response cleanly (SSE error event + `[DONE]`; gRPC status from `ctx.verdict`), the outcome
  becomes STREAM_CUT. Usage found in the response is in `ctx.usage` before the event is seen.
  A filter whose on_event matters only to some requests says so with a class attribute
  `events_when_asked = True` and sets `ctx.wants_events` for those (in an earlier phase); the
  answers to the others are then not parsed for it (the token rule: only a request that
  reserved tokens). A filter whose on_event reads only some kinds of event says which with a
  class attribute `event_kinds` (a frozenset of `EventKind`); an event of a kind no filter
  reads is not made (the answer is still parsed for `ctx.usage` when someone listens).
- `on_response(ctx) -> None` (plain or coroutine): the request is over (`ctx.outcome` says how);
  runs in reverse order for every filter whose `on_request` ran, whatever happened.
- `activate() -> None`: called once when the policy the filter was built for goes live (at start
  and after a successful reload; never for a build that is thrown away).

Filters are built per policy by `factory(section, services)` from their own policy section and
the long-lived `gateway.services.Services`; state that must outlive a reload lives there.
"""

from __future__ import annotations

from typing import Protocol


class Filter(Protocol):
    """Every hook but `name` is optional (see the module docstring)."""

    name: str
