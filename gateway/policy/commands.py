"""`sluice policy check|schema|diff`: validate policy files, print the JSON Schema, show a reload.

`check PATH...` prints `PATH: ok (version HASH)` or one `PATH:LINE:COL: message` line per error
(exit 1 if any file is invalid). `schema` prints the JSON Schema of `Policy`, stable byte for byte
(it is shipped as policies/schema.json). `diff OLD NEW` prints what reloading NEW over OLD would
change, one line each: `+ added`, `- removed`, `~ changed: old -> new`, and `! ...: needs a
restart` for settings that a hot reload does not apply.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gateway.errors import PolicyError
from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy

# Applied when a listener (or the in-process mock backend) is created, so a reload cannot change
# them: the gRPC server options are fixed at grpc.aio.server() time.
RESTART_PREFIXES = ("listeners.", "limits.grpc_", "mock_backend.")
# Lists of named items are compared by name, so a reorder or an edit reads as such.
KEYED_LISTS = ("backends", "routes")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="validate policy files")
    check.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    sub.add_parser("schema", help="print the JSON Schema of the policy document")
    diff = sub.add_parser("diff", help="show what reloading NEW over OLD would change")
    diff.add_argument("old", type=Path, metavar="OLD")
    diff.add_argument("new", type=Path, metavar="NEW")


def run(args: argparse.Namespace) -> int:
    if args.policy_command == "check":
        return check(args.paths)
    if args.policy_command == "schema":
        print(schema_text(), end="")
        return 0
    return diff(args.old, args.new)


def _load(path: Path) -> tuple[Policy | None, str, list[str]]:
    # Imported here so that `schema` needs no yaml.
    from gateway.policy.loader import load_policy

    try:
        policy = load_policy(path)
        return policy, compile_policy(policy).version, []
    except PolicyError as e:
        return None, "", e.errors


def check(paths: list[Path]) -> int:
    code = 0
    for path in paths:
        _, version, errors = _load(path)
        if errors:
            code = 1
            print("\n".join(errors))
        else:
            print(f"{path}: ok (version {version})")
    return code


def schema_text() -> str:
    schema = Policy.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Sluice policy"
    return json.dumps(schema, sort_keys=True, indent=2) + "\n"


def diff(old_path: Path, new_path: Path) -> int:
    old, old_version, old_errors = _load(old_path)
    new, new_version, new_errors = _load(new_path)
    if old is None or new is None:
        print("\n".join(old_errors + new_errors))
        return 1
    lines = diff_policies(old, new)
    print(f"version {old_version} -> {new_version}")
    print("\n".join(lines) if lines else "no changes")
    return 0


def diff_policies(old: Policy, new: Policy) -> list[str]:
    """Readable lines describing what changes from `old` to `new` (empty if nothing does)."""
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    lines: list[str] = []
    for key in a.keys() | b.keys():
        if key in KEYED_LISTS:
            continue
        _diff_value(key, a.get(key), b.get(key), lines)
    for key in KEYED_LISTS:
        _diff_named(key, a[key], b[key], lines)
    out = sorted(lines, key=_sort_key)
    restarts = sorted({_restart_line(line) for line in out} - {""})
    return out + restarts


def _sort_key(line: str) -> tuple[int, str]:
    # Settings first, then backends, then routes; within each, by path.
    path = line[2:]
    rank = 2 if path.startswith("routes") else 1 if path.startswith("backends") else 0
    return rank, path


def _restart_line(line: str) -> str:
    path = line[2:].split(":", 1)[0]
    if any(path.startswith(p) or f"{path}." == p for p in RESTART_PREFIXES):
        return f"! {path}: needs a restart"
    return ""


def _show(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(", ", ": "))


def _diff_value(path: str, a: Any, b: Any, lines: list[str]) -> None:
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in a.keys() | b.keys():
            _diff_value(f"{path}.{key}", a.get(key), b.get(key), lines)
        return
    lines.append(f"~ {path}: {_show(a)} -> {_show(b)}")


def _diff_named(
    section: str, a: list[dict[str, Any]], b: list[dict[str, Any]], lines: list[str]
) -> None:
    old = {item["name"]: item for item in a}
    new = {item["name"]: item for item in b}
    for name in old.keys() - new.keys():
        lines.append(f"- {section}[name={name}]")
    for name in new.keys() - old.keys():
        lines.append(f"+ {section}[name={name}]")
    for name in old.keys() & new.keys():
        _diff_value(f"{section}[name={name}]", old[name], new[name], lines)
    kept_old = [n for n in old if n in new]
    kept_new = [n for n in new if n in old]
    if kept_old != kept_new:  # route order decides which route matches first
        lines.append(f"~ {section} order: {', '.join(kept_old)} -> {', '.join(kept_new)}")
