"""(compiled) What a request routed on its body brings to the member choice of its route
(`gateway.filters.routing.RoutePicker`): who serves its model in each backend of the split,
who would load it (an adapter's parent's members), and its prompt-prefix key; kept on the
try (`Attempt.choice`) for its retries."""

from __future__ import annotations

from collections.abc import Callable

from gateway.core.models import Serving
from gateway.registry.member import Member

MAX_SERVED = 1024  # models remembered per route picker
Servings = tuple[Serving | None, ...]  # per backend of a route's split: who serves the model
Served = tuple[Servings, Servings | None]  # who serves a model; who would load it (adapters)


class Choice:
    """What a request routed on its body brings to the member choice (kept for its retries):
    who serves its model in each backend (None: no model routing), its prompt-prefix key."""

    __slots__ = ("servings", "fallback", "prefix")

    def __init__(self, served: Served | None, prefix: int | None) -> None:
        self.servings: Servings | None = None
        self.fallback: Servings | None = None
        if served is not None:
            self.servings, self.fallback = served
        self.prefix = prefix


def admits(members: frozenset[str] | None, tried: tuple[Member, ...]) -> Callable[[Member], bool]:
    """Which members may take the try: those serving the model (`members`; None: all), not
    used by an earlier try."""
    if members is None:
        return lambda m: m not in tried
    if not tried:
        return lambda m: m.address in members
    return lambda m: m.address in members and m not in tried
