"""The policy reference page (docs/reference/policy.md), rendered from the policy's JSON Schema
(`policy_schema()`, what `sluice policy schema` prints): every section, field, type, default,
description and constraint. `sluice policy docs` prints it; a test holds the committed page
equal to it, so the page cannot drift from the models.

Sections are grouped under the top-level field that first reaches them, in the order the
document declares its fields; a section reached from several places lists each place.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from gateway.policy.schema import policy_schema

REGENERATE = ".venv/bin/sluice policy docs > docs/reference/policy.md"
NULL: dict[str, Any] = {"type": "null"}
# Outside code spans, these would start emphasis, HTML or a table column.
MARKDOWN_SPECIAL = re.compile(r"([|*<\[\]])")


def _name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _anchor(model: str) -> str:
    return model.lower()


def _branches(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives of a node (anyOf / oneOf), without `null`."""
    for key in ("anyOf", "oneOf"):
        if key in node:
            out: list[dict[str, Any]] = []
            for b in node[key]:
                if b != NULL:
                    out += _branches(b)
            return out
    return [node]


def _nullable(node: dict[str, Any]) -> bool:
    return any(b == NULL for b in node.get("anyOf", ()))


def _refs(node: Any) -> Iterator[str]:
    """Every model a node names, in order."""
    if isinstance(node, dict):
        if "$ref" in node:
            yield _name(node["$ref"])
        for key, value in node.items():
            if key not in ("default", "examples"):
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _code(value: str) -> str:
    """An inline code span that holds any text (a backtick inside gets a longer fence)."""
    fence = "``" if "`" in value else "`"
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{fence}{pad}{value}{pad}{fence}"


def _text(value: str) -> str:
    """Prose for a table cell: one line; specials escaped outside code spans."""
    parts = re.split(r"(`[^`]*`)", " ".join(value.split()))
    return "".join(
        p
        if p.startswith("`") and p.endswith("`") and len(p) > 1
        else MARKDOWN_SPECIAL.sub(r"\\\1", p)
        for p in parts
    )


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _type(node: dict[str, Any]) -> str:
    branches = _branches(node)
    if len(branches) > 1:
        return " or ".join(_type(b) for b in branches)
    node = branches[0]
    if "$ref" in node:
        model = _name(node["$ref"])
        return f"[{model}](#{_anchor(model)})"
    if "const" in node:
        return _code(_json(node["const"]))
    if "enum" in node:
        return " \\| ".join(_code(_json(v)) for v in node["enum"])
    kind = node.get("type")
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    if kind == "object" or "additionalProperties" in node:
        values = node.get("additionalProperties")
        if isinstance(values, dict):
            return f"map of string to {_type(values)}"
        return "object"
    if isinstance(kind, str):
        return kind
    return "any"


def _bounds(node: dict[str, Any]) -> list[str]:
    out: list[str] = []
    low = (">", node["exclusiveMinimum"]) if "exclusiveMinimum" in node else None
    low = ("≥", node["minimum"]) if "minimum" in node else low
    high = ("<", node["exclusiveMaximum"]) if "exclusiveMaximum" in node else None
    high = ("≤", node["maximum"]) if "maximum" in node else high
    if low and high and low[0] == "≥" and high[0] == "≤":
        out.append(f"from {_json(low[1])} to {_json(high[1])}")
    else:
        out += [f"{b[0]} {_json(b[1])}" for b in (low, high) if b is not None]
    shortest, longest = node.get("minLength"), node.get("maxLength")
    if longest is not None:
        lowest = "at most " if shortest in (None, 0) else f"{shortest} to "
        out.append(f"{lowest}{longest} characters")
    elif shortest == 1:
        out.append("not empty")
    elif shortest is not None:
        out.append(f"at least {shortest} characters")
    if "minItems" in node:
        out.append(f"at least {node['minItems']} items")
    if "maxItems" in node:
        out.append(f"at most {node['maxItems']} items")
    if "minProperties" in node:
        out.append(f"at least {node['minProperties']} entries")
    if "pattern" in node:
        out.append(f"matches {_code(node['pattern'])}")
    return out


def _constraints(node: dict[str, Any]) -> list[str]:
    """Bounds of the value, of each item and of a map's keys and values, each once."""
    out: list[str] = []
    for b in _branches(node):
        out += _bounds(b)
        items = b.get("items")
        if isinstance(items, dict):
            out += [f"each item {c}" for c in _bounds(items)]
        keys = b.get("propertyNames")
        if isinstance(keys, dict):
            said = keys.get("description")
            out += [f"keys: {said}"] if said else []
            out += [f"each key {c}" for c in _bounds(keys)]
        values = b.get("additionalProperties")
        if isinstance(values, dict):
            said = values.get("description")
            out += [f"values: {said}"] if said else []
            out += [f"each value {c}" for c in _bounds(values)]
        if "description" in b and b is not node:
            out.append(b["description"])
    return list(dict.fromkeys(out))


def _field_defaults(model: dict[str, Any]) -> dict[str, Any]:
    return {k: p["default"] for k, p in model.get("properties", {}).items() if "default" in p}


def _default(node: dict[str, Any], required: bool, defs: dict[str, Any]) -> str:
    if required:
        return "required"
    if "default" not in node:
        return ""
    value = node["default"]
    if value is None:
        return "none"
    refs = [_name(b["$ref"]) for b in _branches(node) if "$ref" in b]
    if isinstance(value, dict) and len(refs) == 1 and value == _field_defaults(defs[refs[0]]):
        return f"[its fields' defaults](#{_anchor(refs[0])})"
    return _code(_json(value))


def _sentence(text: str) -> str:
    return text if text.endswith((".", "!", "?")) else text + "."


def _describe(node: dict[str, Any]) -> str:
    parts = []
    if node.get("description"):
        parts.append(_sentence(_text(node["description"])))
    said = _constraints(node)
    if said:
        parts.append("Bounds: " + "; ".join(_text(c) for c in said) + ".")
    if node.get("examples"):
        parts.append("Examples: " + ", ".join(_code(_json(e)) for e in node["examples"]) + ".")
    return " ".join(parts)


def _table(model: dict[str, Any], defs: dict[str, Any]) -> list[str]:
    required = set(model.get("required", ()))
    lines = ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    for field, node in model.get("properties", {}).items():
        kind = _type(node) + (" or null" if _nullable(node) and "default" in node else "")
        lines.append(
            f"| `{field}` | {kind} | {_default(node, field in required, defs)} | "
            f"{_describe(node)} |"
        )
    return lines


def _places(schema: dict[str, Any]) -> dict[str, list[str]]:
    """Each model and the dotted paths that reach it (`[]` for an item of a list, `.*` for a
    value of a map), in the order a reader meets them."""
    defs: dict[str, Any] = schema["$defs"]
    places: dict[str, list[str]] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                model = _name(node["$ref"])
                seen = model in places
                places.setdefault(model, [])
                if path not in places[model]:
                    places[model].append(path)
                if not seen:
                    for field, sub in defs[model].get("properties", {}).items():
                        walk(sub, f"{path}.{field}")
            for key in ("anyOf", "oneOf"):
                for b in node.get(key, ()):
                    walk(b, path)
            if isinstance(node.get("items"), dict):
                walk(node["items"], f"{path}[]")
            if isinstance(node.get("additionalProperties"), dict):
                walk(node["additionalProperties"], f"{path}.*")

    for field, node in schema["properties"].items():
        walk(node, field)
    return places


def reference_text(schema: dict[str, Any] | None = None) -> str:
    """The page, as Markdown (stable: the same schema gives the same bytes)."""
    import yaml  # only this command needs it

    schema = policy_schema() if schema is None else schema
    defs: dict[str, Any] = schema["$defs"]
    places = _places(schema)
    out = [
        "# Policy reference",
        "",
        "<!-- Generated from the policy schema by `sluice policy docs`; do not edit by hand. -->",
        "",
        _text(schema["description"]),
        "",
        "This page is generated from the same models that validate a policy, so every field, "
        "type, default and bound here is the one Sluice enforces. The JSON Schema itself is "
        "`sluice policy schema` (shipped as `policies/schema.json` for editors). After a change "
        f"to the policy models, regenerate this page with `{REGENERATE}`; a test fails while "
        "it is stale.",
        "",
        "How to read the tables: *required* fields have no default; *none* means the field is "
        "unset (null) unless written; a section whose default is *its fields' defaults* is "
        "present with every field at its default when it is left out. Every section refuses "
        "fields it does not know (`sluice policy check` names the nearest known one).",
        "",
        "## Example",
        "",
        "```yaml",
        *[
            yaml.safe_dump(e, sort_keys=False, default_flow_style=None).rstrip()
            for e in schema.get("examples", ())
        ],
        "```",
        "",
        "## The document",
        "",
        "The top level of a policy file.",
        "",
        *_table(schema, defs),
        "",
    ]
    grouped: dict[str, list[str]] = {}
    for model, paths in places.items():
        top = re.split(r"[.\[]", paths[0], maxsplit=1)[0]
        grouped.setdefault(top, []).append(model)
    for top in schema["properties"]:
        if top not in grouped:
            continue
        out += [f"## `{top}`", ""]
        for model in grouped[top]:
            node = defs[model]
            where = ", ".join(f"`{p}`" for p in places[model])
            out += [f"### {model} {{#{_anchor(model)}}}", "", f"At {where}.", ""]
            if node.get("description"):
                paragraphs = node["description"].split("\n\n")
                for paragraph in paragraphs:
                    out += [_text(paragraph), ""]
            out += [*_table(node, defs), ""]
    return "\n".join(out).rstrip("\n") + "\n"
