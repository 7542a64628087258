"""`sluice policy ...`: validate policy files, print the JSON Schema, show and ship a reload.

`check PATH...` prints `PATH: ok (version HASH)` (then a `PATH:LINE:COL: warning: ...` line per
valid but unsafe setting, such as `insecure_skip_verify`) or one `PATH:LINE:COL: message` line per
error (exit 1 if any file is invalid; the TLS files the listeners name are loaded and checked too,
as the backends' are at every load); with `--against ADMIN_URL` it also prints what the change
guard of that running gateway would say (exit 2 if it would hold the change). `schema` prints
the JSON Schema of `Policy`, stable byte for byte (shipped as policies/schema.json), and `docs`
the reference page rendered from it (docs/reference/policy.md). `diff OLD NEW`
prints what reloading NEW over OLD would change, one line each: `+ added`, `- removed`,
`~ changed: old -> new`, and `! ...: needs a restart` for settings that a hot reload does not
apply, then the guard's findings (judged on a running gateway's traffic with `--against`; OLD
may then be left out: the running policy). `apply` reloads a running gateway (`--force` past the
guard, `--rollout` stages), `rollout status|promote|abort` drives a staged rollout by hand, and
`checksum PATH [--write]` computes (or writes) the file's `checksum:` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from gateway.errors import AdminError, PolicyError
from gateway.policy.compiled import compile_policy
from gateway.policy.model import Policy
from gateway.policy.schema import schema_text

# Applied when a listener (or the in-process mock backend) is created, so a reload cannot change
# them: the gRPC server options are fixed at grpc.aio.server() time.
RESTART_PREFIXES = (
    "listeners.",
    "limits.grpc_",
    "limits.http2.",
    "mock_backend.",
    "timeouts.tls_handshake_s",
)
# Lists of named items are compared by name, so a reorder or an edit reads as such.
KEYED_LISTS = ("backends", "routes")
HELD_EXIT = 2  # the change guard would hold (or held) the change


def configure(parser: argparse.ArgumentParser) -> None:
    from gateway.policyctl.remote import DEFAULT_ADMIN

    sub = parser.add_subparsers(dest="policy_command", required=True, metavar="ACTION")

    def action(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text)  # listed and on its own --help

    check = action("check", "validate policy files")
    check.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    check.add_argument(
        "--against", metavar="ADMIN_URL", help="also run the change guard of this gateway"
    )
    action("schema", "print the JSON Schema of the policy document")
    action("docs", "print the policy reference page (docs/reference/policy.md)")
    diff = action("diff", "show what reloading NEW over OLD would change")
    diff.add_argument("files", nargs="+", type=Path, metavar="[OLD] NEW")
    diff.add_argument(
        "--against", metavar="ADMIN_URL", help="judge on this gateway's traffic (OLD: its policy)"
    )
    apply = action("apply", "reload a running gateway's policy file now")
    apply.add_argument("--admin", default=DEFAULT_ADMIN, metavar="URL")
    apply.add_argument("--force", action="store_true", help="apply even if the guard holds it")
    apply.add_argument(
        "--rollout", metavar="STAGES", help="stages, e.g. shadow,5,25,100 (none: all at once)"
    )
    apply.add_argument("--hold-s", type=float, metavar="SECONDS", help="seconds per stage")
    ro = action("rollout", "show or drive a staged rollout")
    ro.add_argument("action", choices=["status", "promote", "abort"])
    ro.add_argument("--admin", default=DEFAULT_ADMIN, metavar="URL")
    cs = action("checksum", "print (or --write) the file's checksum: line")
    cs.add_argument("path", type=Path, metavar="PATH")
    cs.add_argument("--write", action="store_true", help="write it into the file (atomically)")


def run(args: argparse.Namespace) -> int:
    cmd = args.policy_command
    try:
        if cmd == "check":
            return check(args.paths, args.against)
        if cmd == "schema":
            print(schema_text(), end="")
            return 0
        if cmd == "docs":
            from gateway.policy.reference import reference_text

            print(reference_text(), end="")
            return 0
        if cmd == "diff":
            return diff_command(args.files, args.against)
        if cmd == "apply":
            return apply(args.admin, args.force, args.rollout, args.hold_s)
        if cmd == "rollout":
            return rollout(args.admin, args.action)
        return checksum(args.path, args.write)
    except AdminError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 1


def _load(path: Path, check_files: bool = False) -> tuple[Policy | None, str, list[str]]:
    policy, version, errors, _ = _checked(path, check_files)
    return policy, version, errors


def _checked(
    path: Path, check_files: bool = False
) -> tuple[Policy | None, str, list[str], list[str]]:
    """(policy, version, error lines, warning lines)."""
    # Imported here so that `schema` needs no yaml.
    from gateway.policy.loader import checked_policy

    try:
        policy, warnings = checked_policy(path, check_files)
        return policy, compile_policy(policy).version, [], warnings
    except PolicyError as e:
        return None, "", e.errors, []


def check(paths: list[Path], against: str | None = None) -> int:
    from gateway.policyctl.remote import guard_against

    code = 0
    for path in paths:
        policy, version, errors, warnings = _checked(path, check_files=True)
        if errors:
            code = 1
            print("\n".join(errors))
            continue
        print(f"{path}: ok (version {version})")
        if warnings:  # valid, but unsafe: said on every check, the exit code stays 0
            print("\n".join(warnings))
        if against is not None and policy is not None:
            report = guard_against(against, policy)
            print("\n".join(report.lines()))
            if report.held and code == 0:
                code = HELD_EXIT
    return code


def diff_command(files: list[Path], against: str | None) -> int:
    if len(files) > 2 or (len(files) == 1 and against is None):
        print("sluice: diff takes OLD NEW, or NEW --against ADMIN_URL", file=sys.stderr)
        return 1
    return diff(files[0] if len(files) == 2 else None, files[-1], against)


def diff(old_path: Path | None, new_path: Path, against: str | None = None) -> int:
    from gateway.reload.guard import static_warnings

    new, new_version, new_errors = _load(new_path)
    old_errors: list[str] = []
    if old_path is not None:
        old, old_version, old_errors = _load(old_path)
    else:
        from gateway.policyctl.remote import running

        serving, _ = running(against or "")
        old, old_version = serving.policy, serving.version
    if old is None or new is None:
        print("\n".join(old_errors + new_errors))
        return 1
    lines = diff_policies(old, new)
    print(f"version {old_version} -> {new_version}")
    print("\n".join(lines) if lines else "no changes")
    if against is None:
        for w in static_warnings(new):
            print(f"warning: {w}")
        return 0
    from gateway.policyctl.remote import guard_against

    report = guard_against(against, new, old)
    print("\n".join(report.lines()))
    return HELD_EXIT if report.held else 0


def apply(admin: str, force: bool, stages: str | None, hold_s: float | None) -> int:
    from gateway.policyctl.remote import call, reload_query, rollout_lines

    code, st = call(admin, "/admin/policy/reload" + reload_query(force, stages, hold_s), "POST")
    if code == 400:
        print(f"sluice: {st.get('error', {}).get('message', st)}", file=sys.stderr)
        return 1
    last = st.get("last_reload", {})
    if last.get("errors"):
        print("\n".join(last["errors"]))
        return 1
    if last.get("held"):
        held = st.get("held") or {}
        print(f"held: version {held.get('version')} not applied: {held.get('reason')}")
        print("\n".join(held.get("lines") or []))
        return HELD_EXIT
    if last.get("rollout"):
        print("\n".join(rollout_lines(st.get("rollout"))))
        return 0
    print(f"serving version {st['version']}" + ("" if last.get("changed") else " (unchanged)"))
    return 0


def rollout(admin: str, action: str) -> int:
    from gateway.policyctl.remote import call, rollout_lines

    if action == "status":
        code, st = call(admin, "/admin/policy/rollout")
    else:
        code, st = call(admin, f"/admin/policy/rollout/{action}", "POST")
    if code == 404:
        print("no rollout in progress")
        return 1
    if code != 200:
        raise AdminError(f"{admin}: HTTP {code}: {st}")
    print("\n".join(rollout_lines(st)))
    return 0


def checksum(path: Path, write: bool) -> int:
    from gateway.policy.loader import CHECKSUM_LINE, load_policy_text, policy_checksum

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as e:
        print(f"{path}:1:1: cannot read: {e}", file=sys.stderr)
        return 1
    line = f"checksum: {policy_checksum(text)}"
    if not write:
        print(line)
        return 0
    body = CHECKSUM_LINE.sub("", text)
    out = f"{line}\n{body}"
    try:
        load_policy_text(out, str(path))
    except PolicyError as e:
        print("\n".join(e.errors))
        return 1
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:  # the atomic way: write, fsync, rename
        f.write(out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    print(line)
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
