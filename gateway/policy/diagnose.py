"""What the loader adds to pydantic's errors, so that one pass over a broken file says everything:

- `suggest(path, name)`: for an unknown field, the nearest known field of the model at `path`
  (`routes[0].timeout: unknown field; did you mean 'timeouts'?`);
- `lenient(data, errors)`: a best-effort `Policy` from a document with schema errors: the
  offending keys (and, when that is not enough, the items holding them) are pruned until the
  rest validates, so the cross-field checks (`model.reference_errors`) can run on it too. Their
  locations are mapped back to the original document. A reference to an item that was pruned
  for its own errors is not reported again (the item's error says it already).

Pure: no I/O, no positions (the loader maps locations to lines).
"""

from __future__ import annotations

import copy
import difflib
import inspect
import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from gateway.policy.model import Loc, Policy, reference_errors

MAX_PASSES = 8


def candidate_types(tp: Any) -> list[Any]:
    """The candidate types of an annotation: Annotated and Optional stripped, unions split."""
    if get_origin(tp) is Annotated:
        return candidate_types(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        out: list[Any] = []
        for arg in get_args(tp):
            if arg is not type(None):
                out += candidate_types(arg)
        return out
    return [tp]


def _child(tp: Any, part: str | int) -> list[Any]:
    out: list[Any] = []
    for t in candidate_types(tp):
        if inspect.isclass(t) and issubclass(t, BaseModel):
            if isinstance(part, str) and part in t.model_fields:
                out.append(t.model_fields[part].annotation)
            continue
        origin, args = get_origin(t), get_args(t)
        if origin in (list, tuple, Sequence) and isinstance(part, int) and args:
            out.append(args[0])
        elif origin in (dict, Mapping) and len(args) == 2:
            out.append(args[1])
    return out


def model_at(path: Loc) -> type[BaseModel] | None:
    """The model class of the mapping at data path `path` (None if it is not a model)."""
    types_: list[Any] = [Policy]
    for part in path:
        types_ = [c for t in types_ for c in _child(t, part)]
    for t in types_:
        for u in candidate_types(t):
            if inspect.isclass(u) and issubclass(u, BaseModel):
                return u
    return None


def suggest(path: Loc, name: str) -> str:
    """`unknown field` plus the nearest known field of the mapping at `path`, or the list."""
    model = model_at(path)
    if model is None:
        return "unknown field"
    known = list(model.model_fields)
    lowered = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    if close:
        return f"unknown field; did you mean {lowered[close[0]]!r}?"
    return f"unknown field (known: {', '.join(known)})"


def _data_path(loc: Sequence[str | int], data: Any) -> Loc | None:
    """The part of an error location that exists in `data`, pydantic's tags skipped. For a
    missing field: the path of the mapping that lacks it."""
    path: list[str | int] = []
    cur = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(cur, dict):
            key: Any = part if part in cur else str(part)
            if key in cur:
                path.append(key)
                cur = cur[key]
            elif last:
                break  # a missing field: its mapping is at fault
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            path.append(part)
            cur = cur[part]
        elif not isinstance(cur, dict | list):
            break
    return tuple(path)


class _Pruner:
    def __init__(self, data: dict[str, Any]) -> None:
        self.work = copy.deepcopy(data)
        self.index: dict[int, list[int]] = {}  # id(list) -> original indices still present
        self.pruned_names: set[str] = set()
        self._register(self.work)

    def _register(self, v: Any) -> None:
        if isinstance(v, list):
            self.index[id(v)] = list(range(len(v)))
            for x in v:
                self._register(x)
        elif isinstance(v, dict):
            for x in v.values():
                self._register(x)

    def remove(self, path: Loc) -> bool:
        parent: Any = self.work
        for part in path[:-1]:
            parent = parent[part]
        key = path[-1]
        if isinstance(parent, list) and isinstance(key, int) and key < len(parent):
            item = parent[key]
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                self.pruned_names.add(item["name"])
            del parent[key]
            del self.index[id(parent)][key]
            return True
        if isinstance(parent, dict) and key in parent:
            del parent[key]
            return True
        return False

    def original(self, loc: Loc) -> Loc:
        out: list[str | int] = []
        cur: Any = self.work
        for part in loc:
            if isinstance(cur, list) and isinstance(part, int) and part < len(cur):
                out.append(self.index[id(cur)][part])
                cur = cur[part]
            elif isinstance(cur, dict) and part in cur:
                out.append(part)
                cur = cur[part]
            else:
                out.append(part)
                cur = None
        return tuple(out)


def _order(path: Loc) -> tuple[int, tuple[tuple[int, Any], ...]]:
    # Deepest first, and within one list the highest index first, so that removing an item
    # never shifts another path still to be removed.
    return len(path), tuple((0, p) if isinstance(p, int) else (1, p) for p in path)


def lenient_reference_errors(
    data: dict[str, Any], errors: Sequence[Mapping[str, Any]]
) -> list[tuple[Loc, str]]:
    """Cross-field problems of a document whose schema validation failed with `errors`,
    located in the original document; [] when nothing valid is left to check."""
    p = _Pruner(data)
    errs: Sequence[Mapping[str, Any]] = list(errors)
    for _ in range(MAX_PASSES):
        targets = set()
        for err in errs:
            path = _data_path(tuple(err["loc"]), p.work)
            if not path:
                return []  # the document itself is at fault: nothing to salvage
            targets.add(path)
        if not any(p.remove(t) for t in sorted(targets, key=_order, reverse=True)):
            return []
        try:
            policy = Policy.model_validate(p.work, context={"defer_references": True})
        except ValidationError as e:
            errs = e.errors()
            continue
        out = []
        for loc, msg in reference_errors(policy):
            if any(f"{n!r}" in msg for n in p.pruned_names):
                continue
            out.append((p.original(loc), msg))
        return out
    return []
