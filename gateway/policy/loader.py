"""Reads a policy file: YAML → plain data with node positions → `Policy`. The only yaml import.

Every problem becomes one `PATH:LINE:COL: field.path: message` line (1-based), so an SRE can jump
straight to it. The YAML is composed into nodes with `yaml.SafeLoader` (no Python tags, ever) and
turned into data by hand, which is what lets us keep positions and refuse what PyYAML accepts
silently:

- files over `MAX_BYTES` (1 MiB): a policy is a few KiB; anything larger is a mistake or an attack;
- duplicate mapping keys (PyYAML keeps the last one without a word);
- alias bombs ("billion laughs"): aliases are allowed, but expanding the document may build at
  most `MAX_NODES` (100 000) values; nesting deeper than `MAX_DEPTH` is refused too;
- merge keys (`<<`), explicit tags on collections, non-scalar keys, and an empty document.

Validation reports everything in one pass: the schema (pydantic; an unknown field names the
nearest known one), and the cross-references (`model.reference_errors`: unknown backend,
duplicate names, ...), checked on what is left of the document once its schema errors are
pruned (`diagnose.py`) when the schema does not hold, each reported at the node at fault. Once
the schema holds, each backend's `tls` files are read and its contexts built
(`upstream_tls_errors`): a file that cannot be read, is not PEM, or a key that does not match
its certificate is an error at that field. Valid but unsafe settings (`insecure_skip_verify`)
come back as warnings (`checked_policy`), which `sluice policy check` prints and the serving
gateway logs at each load (`gateway.reload.holder`); nothing here logs them.

Two optional fields let a policy prove it was read whole (a slow writer's half-file is refused):
`checksum: sha256:HEX` (the sha256 of the file without its `checksum:` line; `policy_checksum`
computes it, `sluice policy checksum FILE --write` writes it) and `end_marker: TEXT` (the last
non-empty line of the file must be TEXT; put the field at the top).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.errors import PolicyError, TlsError
from gateway.policy.diagnose import lenient_reference_errors, suggest
from gateway.policy.model import Loc, Policy, format_loc, reference_errors, reference_warnings

MAX_BYTES = 1024 * 1024
MAX_NODES = 100_000
MAX_DEPTH = 64
MAX_ERRORS = 50  # more lines than this help nobody; the rest is counted

Pos = tuple[int, int]
_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """SafeLoader: constructs only plain YAML types; we never call its Python-object paths."""


class _TooBig(Exception):
    def __init__(self, pos: Pos, message: str) -> None:
        self.pos = pos
        self.message = message


def _pos(node: yaml.Node) -> Pos:
    return node.start_mark.line + 1, node.start_mark.column + 1


class _Builder:
    """Turns a composed node graph into dicts/lists/scalars and records where each value sits."""

    def __init__(self, loader: _Loader) -> None:
        self._loader = loader
        self.nodes = 0
        self.values: dict[Loc, Pos] = {}  # data path → position of the value node
        self.keys: dict[Loc, Pos] = {}  # data path → position of its key (for mappings)
        self.errors: list[tuple[Pos, str, str]] = []  # (position, dotted path, message)

    def build(self, node: yaml.Node, path: Loc, depth: int = 0) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _TooBig(
                _pos(node), f"document expands to more than {MAX_NODES} values (alias bomb?)"
            )
        if depth > MAX_DEPTH:
            raise _TooBig(_pos(node), f"nested deeper than {MAX_DEPTH} levels")
        self.values.setdefault(path, _pos(node))
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, depth)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ_TAG:
                self._error(node, path, f"unsupported tag {node.tag!r} on a list")
            return [self.build(n, (*path, i), depth + 1) for i, n in enumerate(node.value)]
        try:
            return self._loader.construct_object(node)
        except yaml.constructor.ConstructorError as e:
            self._error(node, path, e.problem or str(e))
            return None

    def _mapping(self, node: yaml.MappingNode, path: Loc, depth: int) -> dict[str, Any]:
        if node.tag != _MAP_TAG:
            self._error(node, path, f"unsupported tag {node.tag!r} on a mapping")
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                self._error(key_node, path, "merge keys (<<) are not supported; repeat the fields")
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self._error(key_node, path, "mapping keys must be plain strings")
                continue
            # The key's text, not its YAML 1.1 value: `on:` or `no:` stay strings, not booleans.
            key: str = key_node.value
            child = (*path, key)
            if key in out:
                first = self.keys[child]
                self._error(key_node, child, f"duplicate key {key!r} (first at line {first[0]})")
                continue
            self.keys[child] = _pos(key_node)
            out[key] = self.build(value_node, child, depth + 1)
        return out

    def _error(self, node: yaml.Node, path: Loc, message: str) -> None:
        self.errors.append((_pos(node), format_loc(path), message))


def _position(loc: Loc, data: Any, b: _Builder, key_first: bool) -> tuple[Loc, Pos]:
    """The data path that `loc` names (pydantic adds union-member tags, we skip them), and the
    closest recorded position: the key for an unknown field, else the value, else its parent."""
    path: list[str | int] = []
    cur = data
    for i, part in enumerate(loc):
        if isinstance(cur, dict):
            key = part if part in cur else str(part)  # dict[int, ...] keys are text in YAML
            if key in cur:
                cur = cur[key]
                path.append(key)
            elif isinstance(part, str) and i == len(loc) - 1 and part.isidentifier():
                path.append(part)  # a missing field: name it, point at its parent mapping
                break
            # else a union tag ('long-form', "literal[...]"): not part of the document's path
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            cur = cur[part]
            path.append(part)
        # anything else is a tag pydantic adds, e.g. 'function-after[...]' or a union member
    found = tuple(path)
    if key_first and found in b.keys:
        return found, b.keys[found]
    probe = found
    while probe:
        if probe in b.values:
            return found, b.values[probe]
        probe = probe[:-1]
    return found, b.values.get((), (1, 1))


def _message(err: Any, found: Loc) -> str:
    msg = str(err["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    if err["type"] == "extra_forbidden":
        return suggest(found[:-1], str(found[-1])) if found else "unknown field"
    if err["type"] == "missing":
        return "required field is missing"
    value = err.get("input")
    if isinstance(value, str | int | float | bool) and len(repr(value)) <= 80:
        return f"{msg}, got {value!r}"
    return msg


def _format(name: str, errors: list[tuple[Pos, str, str]]) -> list[str]:
    errors = sorted(errors, key=lambda e: e[0])
    lines = [
        f"{name}:{line}:{col}: {dotted}: {msg}" if dotted else f"{name}:{line}:{col}: {msg}"
        for (line, col), dotted, msg in errors[:MAX_ERRORS]
    ]
    if len(errors) > MAX_ERRORS:
        lines.append(f"{name}:1:1: ... and {len(errors) - MAX_ERRORS} more errors")
    return lines


def _yaml_error(name: str, text: str, e: yaml.YAMLError) -> PolicyError:
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        where = f"{mark.line + 1}:{mark.column + 1}" if mark else "1:1"
        what = e.problem or e.context or "invalid YAML"
        if e.context and e.problem and e.problem.startswith("but "):
            what = f"{e.context}, {e.problem}"  # PyYAML splits one sentence in two
        elif e.context and e.problem and e.context_mark:
            what = f"{what} ({e.context} at line {e.context_mark.line + 1})"
        return PolicyError([f"{name}:{where}: yaml: {what}"])
    if isinstance(e, yaml.reader.ReaderError):
        before = text[: e.position]
        line, col = before.count("\n") + 1, e.position - (before.rfind("\n") + 1) + 1
        return PolicyError([f"{name}:{line}:{col}: yaml: {e.reason} (#x{e.character:04x})"])
    return PolicyError([f"{name}:1:1: yaml: {e}"])


def load_policy_text(text: str, name: str = "<policy>", check_files: bool = False) -> Policy:
    """Validate policy YAML held in memory; `name` prefixes every error line. `check_files`
    also loads the files the policy names (listeners' TLS certificates, keys and client CAs):
    `sluice policy check` does; `serve` finds the same problems when a listener starts (fatal),
    and a reload does not look (listeners are bound once; their TLS owners watch the files).
    The backends' TLS files are read at every load, whatever `check_files` says: their client
    contexts are built here (`upstream_tls_errors`)."""
    return checked_policy_text(text, name, check_files)[0]


def checked_policy_text(
    text: str, name: str = "<policy>", check_files: bool = False
) -> tuple[Policy, list[str]]:
    """`load_policy_text`, and the policy's warnings (`model.reference_warnings`: valid but
    unsafe settings) as `PATH:LINE:COL: warning: field.path: message` lines."""
    if len(text.encode()) > MAX_BYTES:
        raise PolicyError([f"{name}:1:1: file is larger than {MAX_BYTES} bytes (1 MiB cap)"])
    try:
        loader = _Loader(text)
    except yaml.YAMLError as e:  # the reader checks every character up front
        raise _yaml_error(name, text, e) from None
    try:
        root = loader.get_single_node()
        if root is None:
            raise PolicyError([f"{name}:1:1: the policy document is empty"])
        b = _Builder(loader)
        data = b.build(root, ())
    except yaml.YAMLError as e:
        raise _yaml_error(name, text, e) from None
    except _TooBig as e:
        raise PolicyError([f"{name}:{e.pos[0]}:{e.pos[1]}: {e.message}"]) from None
    except RecursionError:
        raise PolicyError([f"{name}:1:1: yaml: nested too deeply"]) from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        line, col = _pos(root)
        raise PolicyError([f"{name}:{line}:{col}: the top level must be a mapping"])
    errs = list(b.errors)  # YAML-level problems, reported together with the schema's
    errs += _integrity_errors(text, data, b)
    try:
        policy = Policy.model_validate(data, context={"defer_references": True})
    except ValidationError as e:
        for err in e.errors():
            key_first = err["type"] == "extra_forbidden"
            found, pos = _position(tuple(err["loc"]), data, b, key_first)
            errs.append((pos, format_loc(found), _message(err, found)))
        problems = lenient_reference_errors(data, e.errors())
        errs += [(_position(loc, data, b, False)[1], format_loc(loc), m) for loc, m in problems]
        raise PolicyError(_format(name, _unique(errs))) from None
    problems = reference_errors(policy) + upstream_tls_errors(policy)
    if check_files and not problems:
        problems = file_errors(policy)
    errs += [(_position(loc, data, b, False)[1], format_loc(loc), m) for loc, m in problems]
    if errs:
        raise PolicyError(_format(name, _unique(errs)))
    warnings = []
    for loc, m in reference_warnings(policy):
        line, col = _position(loc, data, b, False)[1]
        warnings.append(f"{name}:{line}:{col}: warning: {format_loc(loc)}: {m}")
    return policy, warnings


def upstream_tls_errors(policy: Policy) -> list[tuple[Loc, str]]:
    """Build each backend's TLS contexts now (the files are read once, here: the gateway and
    `sluice policy check` alike), reporting a file that cannot be read or used at its field."""
    from gateway.tls.upstream import client_tls

    out: list[tuple[Loc, str]] = []
    for j, backend in enumerate(policy.backends):
        if backend.tls is None:
            continue
        try:
            client_tls(backend.tls)
        except TlsError as e:
            out.append((("backends", j, "tls", e.field), e.message))
    return out


def file_errors(policy: Policy) -> list[tuple[Loc, str]]:
    """Each TLS file of a listener, and each budget amounts file, that does not load, at its
    field."""
    from gateway.tls.listener import ALPN
    from gateway.tls.material import Changing, load_material

    out: list[tuple[Loc, str]] = []
    for name in ("http", "grpc"):
        listener = getattr(policy.listeners, name)
        if listener is None or listener.tls is None:
            continue
        try:
            load_material(listener.tls, ALPN[name])
        except TlsError as e:
            out.append((("listeners", name, "tls", e.field), e.message))
        except Changing:  # being replaced right now: its next state is checked at start
            pass
    from gateway.budgets.compiled import amounts_errors

    return out + amounts_errors(policy.budgets)


def _unique(errors: list[tuple[Pos, str, str]]) -> list[tuple[Pos, str, str]]:
    return list(dict.fromkeys(errors))


CHECKSUM_LINE = re.compile(r"^checksum:[^\n]*(?:\n|$)", re.MULTILINE)


def policy_checksum(text: str) -> str:
    """`sha256:HEX` of the policy text without its top-level `checksum:` line(s)."""
    body = CHECKSUM_LINE.sub("", text)
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()


def _integrity_errors(text: str, data: dict[str, Any], b: _Builder) -> list[tuple[Pos, str, str]]:
    out: list[tuple[Pos, str, str]] = []
    want = data.get("checksum")
    if isinstance(want, str) and want.startswith("sha256:"):
        got = policy_checksum(text)
        if got != want:
            out.append(
                (
                    b.keys.get(("checksum",), (1, 1)),
                    "checksum",
                    f"checksum mismatch: the file hashes to {got} (incomplete, or edited "
                    "without `sluice policy checksum --write`)",
                )
            )
    marker = data.get("end_marker")
    if isinstance(marker, str) and marker.strip():
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines or lines[-1].strip() != marker.strip():
            out.append(
                (
                    b.keys.get(("end_marker",), (1, 1)),
                    "end_marker",
                    f"the file does not end with its end marker {marker!r} (cut short while "
                    "being written?)",
                )
            )
    return out


def load_policy(path: Path, check_files: bool = False) -> Policy:
    """Read and validate a policy file; raises PolicyError listing every problem found
    (`check_files`: see `load_policy_text`)."""
    return checked_policy(path, check_files)[0]


def checked_policy(path: Path, check_files: bool = False) -> tuple[Policy, list[str]]:
    """`load_policy`, and the policy's warning lines (see `checked_policy_text`)."""
    name = str(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise PolicyError([f"{name}:1:1: cannot read: {e.strerror or e}"]) from None
    if len(raw) > MAX_BYTES:
        raise PolicyError([f"{name}:1:1: file is larger than {MAX_BYTES} bytes (1 MiB cap)"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise PolicyError([f"{name}:{line}:{col}: not valid UTF-8"]) from None
    return checked_policy_text(text, name, check_files)
