"""(compiled) Which members of a backend serve a model: the OpenAI `/v1/models` listing read into
base models and LoRA adapters (each with its parent), and the index a backend's router asks.

Pure: the listings come in as parsed JSON; the I/O that fetches them is
`gateway.registry.models`. Rules (`ModelIndex.serving`):
- a name the backend lists statically (`models.names`) is served by every member;
- a base model or an adapter a member lists is served by that member;
- an adapter no member has loaded, whose parent is known (some member listed it once with its
  `parent`), is served by the members serving the parent when the backend loads adapters on
  demand (`models.lora: load_on_demand`), else by none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

MAX_NAME: Final = 256


@dataclass(frozen=True, slots=True)
class Listing:
    """What one member serves: base model names, and adapters with their parent model."""

    bases: frozenset[str] = frozenset()
    adapters: Mapping[str, str] = field(default_factory=dict)

    def names(self) -> Iterable[str]:
        yield from self.bases
        yield from self.adapters


EMPTY = Listing()


def parse_listing(doc: Any, max_models: int) -> Listing | None:
    """An OpenAI model list (`{"data": [{"id", "parent"?}, ...]}`) as a `Listing`; entries past
    `max_models`, without a string id, or with an id over MAX_NAME characters are dropped. None
    when `doc` is not a model list at all."""
    if not isinstance(doc, dict):
        return None
    data = doc.get("data")
    if not isinstance(data, list):
        return None
    bases: set[str] = set()
    adapters: dict[str, str] = {}
    for item in data:
        if len(bases) + len(adapters) >= max_models:
            break
        if not isinstance(item, dict):
            continue
        ident = item.get("id")
        if not isinstance(ident, str) or not ident or len(ident) > MAX_NAME:
            continue
        parent = item.get("parent")
        if isinstance(parent, str) and parent and parent != ident and len(parent) <= MAX_NAME:
            adapters[ident] = parent
        else:
            bases.add(ident)
    return Listing(frozenset(bases), adapters)


@dataclass(frozen=True, slots=True)
class Serving:
    """The answer for one model: every member (`members` None), or these addresses;
    `via_parent`: an adapter sent to its parent's members, to be loaded there. `fallback`:
    for an adapter some members have loaded, the parent's members (load on demand), to be
    used when none of those can take it."""

    members: frozenset[str] | None
    via_parent: bool = False
    fallback: Serving | None = None


ALL: Final = Serving(None)


class ModelIndex:
    """One backend's model → members map, built from its static names and its members'
    listings (rebuilt whenever one of them changes)."""

    __slots__ = ("static", "by_name", "parents", "on_demand")

    def __init__(
        self,
        static: Iterable[str],
        listings: Mapping[str, Listing],
        on_demand: bool,
        parents: Mapping[str, str] | None = None,
    ) -> None:
        """`parents`: adapters seen before (with their parent) that no member may list now."""
        self.static = frozenset(static)
        self.on_demand = on_demand
        by_name: dict[str, set[str]] = {}
        known = dict(parents or {})
        for address, listing in listings.items():
            for name in listing.names():
                by_name.setdefault(name, set()).add(address)
            known.update(listing.adapters)
        self.by_name = {n: frozenset(a) for n, a in by_name.items()}
        self.parents = known

    def serving(self, model: str) -> Serving | None:
        """Who serves `model` (see the module docstring); None: nobody."""
        if model in self.static:
            return ALL
        got = self.by_name.get(model)
        via = self._via_parent(model)
        if got is not None:
            return Serving(got, fallback=via) if via is not None else Serving(got)
        return via

    def _via_parent(self, model: str) -> Serving | None:
        parent = self.parents.get(model)
        if parent is None or not self.on_demand:
            return None
        if parent in self.static:
            return Serving(None, True)
        members = self.by_name.get(parent)
        return Serving(members, True) if members else None

    def names(self) -> set[str]:
        """Every model and adapter the backend serves (for `GET /v1/models`)."""
        return set(self.static) | set(self.by_name)

    def parent(self, name: str) -> str | None:
        return self.parents.get(name)
