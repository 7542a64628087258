"""(compiled) Filter names in the policy → factories; the chain is built once per policy load.

Each filter is built by `factory(section, services)` from its own policy section (what
`FilterSpec.section` picks out of the compiled policy) and the long-lived services, never from
the whole policy. A factory may return None when its section asks for nothing (the filter is
then left out of the chain and costs nothing).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from gateway.filters.base import Filter
from gateway.filters.chain import Chain
from gateway.policy.compiled import CompiledPolicy
from gateway.services import Services


@dataclass(frozen=True, slots=True)
class FilterSpec:
    factory: str  # "module:callable", imported only when the filter is used
    section: Callable[[CompiledPolicy], Any]  # the part of the policy the filter is built from


FILTERS: Final[dict[str, FilterSpec]] = {
    "request_id": FilterSpec("gateway.filters.request_id:build", lambda c: None),
    "trace": FilterSpec("gateway.filters.trace:build", lambda c: c.policy.tracing),
    "access_log": FilterSpec("gateway.filters.access_log:build", lambda c: c.policy.access_log),
    "ratelimit": FilterSpec("gateway.filters.ratelimit:build", lambda c: c),
    "budget": FilterSpec("gateway.filters.budget:build", lambda c: c),
    "admission": FilterSpec("gateway.filters.admission:build", lambda c: c),
    "route": FilterSpec("gateway.filters.model_routing:build", lambda c: c),
    # auth reads the routes' own `auth` settings too: its section is the compiled policy.
    "auth": FilterSpec(
        "gateway.filters.auth:build", lambda c: c if c.policy.auth is not None else None
    ),
}


def build_chain(policy: CompiledPolicy, services: Services) -> Chain:
    filters: list[Filter] = []
    for name in policy.policy.filters:
        spec = FILTERS[name]
        module, _, attr = spec.factory.partition(":")
        factory: Any = getattr(importlib.import_module(module), attr)
        f = factory(spec.section(policy), services)
        if f is not None:
            filters.append(f)
    return Chain(filters)
