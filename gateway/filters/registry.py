"""Filter names in the policy → filter classes; the chain is built once per policy load."""

from __future__ import annotations

import importlib
from typing import Any

from gateway.filters.base import Filter
from gateway.filters.chain import Chain
from gateway.policy.compiled import CompiledPolicy

FILTERS: dict[str, str] = {
    "request_id": "gateway.filters.request_id:RequestIdFilter",
    "access_log": "gateway.filters.access_log:AccessLogFilter",
    "route": "gateway.filters.routing:RouteFilter",
}


def build_chain(policy: CompiledPolicy) -> Chain:
    filters: list[Filter] = []
    for name in policy.policy.filters:
        module, _, cls = FILTERS[name].partition(":")
        factory: Any = getattr(importlib.import_module(module), cls)
        filters.append(factory(policy))
    return Chain(filters)
