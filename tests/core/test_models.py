"""Model listings and the model → members index: table-driven, pure."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core.models import ALL, Listing, ModelIndex, Serving, parse_listing


def entry(ident: Any, parent: Any = None) -> dict[str, Any]:
    return {"id": ident, "object": "model", "parent": parent}


@pytest.mark.parametrize(
    ("doc", "want"),
    [
        ({"data": [entry("a"), entry("l", "a")]}, Listing(frozenset({"a"}), {"l": "a"})),
        ({"data": [entry("a", "a")]}, Listing(frozenset({"a"}), {})),  # own parent: a base
        ({"data": [entry(1), entry(""), entry("x" * 300), "junk", entry("b")]},
         Listing(frozenset({"b"}), {})),
        ({"data": [entry(f"m{i}") for i in range(10)]},
         Listing(frozenset(f"m{i}" for i in range(3)), {})),  # max_models = 3
        ({"data": "nope"}, None),
        ([], None),
        ({"object": "list"}, None),
    ],
)  # fmt: skip
def test_parse_listing(doc: Any, want: Listing | None) -> None:
    assert parse_listing(doc, 3) == want


A = Listing(frozenset({"llama"}), {"sql": "llama"})
B = Listing(frozenset({"llama", "qwen"}), {})


@pytest.mark.parametrize(
    ("static", "listings", "on_demand", "parents", "model", "want"),
    [
        (["s"], {}, False, {}, "s", ALL),
        ([], {"a": A, "b": B}, False, {}, "llama", Serving(frozenset({"a", "b"}))),
        ([], {"a": A, "b": B}, False, {}, "qwen", Serving(frozenset({"b"}))),
        ([], {"a": A, "b": B}, False, {}, "sql", Serving(frozenset({"a"}))),
        ([], {"a": A, "b": B}, True, {}, "sql",
         Serving(frozenset({"a"}), fallback=Serving(frozenset({"a", "b"}), True))),
        ([], {"b": B}, False, {"sql": "llama"}, "sql", None),  # unloaded, no loading: nobody
        ([], {"b": B}, True, {"sql": "llama"}, "sql", Serving(frozenset({"b"}), True)),
        (["llama"], {}, True, {"sql": "llama"}, "sql", Serving(None, True)),
        ([], {"b": B}, True, {"sql": "gone"}, "sql", None),  # its parent is served by none
        ([], {"a": A}, True, {}, "unknown", None),
    ],
)  # fmt: skip
def test_who_serves_a_model(
    static: list[str],
    listings: dict[str, Listing],
    on_demand: bool,
    parents: dict[str, str],
    model: str,
    want: Serving | None,
) -> None:
    assert ModelIndex(static, listings, on_demand, parents).serving(model) == want


def test_names_and_parents() -> None:
    ix = ModelIndex(["s"], {"a": A, "b": B}, False)
    assert ix.names() == {"s", "llama", "qwen", "sql"}
    assert ix.parent("sql") == "llama" and ix.parent("llama") is None
