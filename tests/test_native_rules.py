"""The rules the compiled request path (`gateway.native`) keeps, as docs/contributing.md ("The
compiled request path") states them, checked on the sources of the compiled modules:

- no `await` (nor `async for`, `async with`) inside an `except` or `finally` block. mypyc keeps
  one exception state per thread, not per coroutine, so such a block restores, when it ends, a
  state saved while an exception was thrown into the task, and that exception is raised again
  later: a failed backend TLS handshake was answered 502 and then raised out of the request
  (`tests/integration/test_upstream_tls.py` shows it end to end);
- no `async with` on a manager whose `__aexit__` may suspend (mypyc awaits it inside a hidden
  except/finally): only the managers in `NEVER_SUSPENDS`;
- no async generators;
- only literal class defaults (dataclasses, enums and named tuples aside);
- no attribute narrowed across an `await` (`if self.conn is not None: await ...;
  self.conn.write()`);
- sums name their start (`sum(..., 0.0)` for floats);
- a one-byte string is not looked for with `in` (`b"\\n" in data`): its value is (`0x0A in data`);
- a module constant read inside a function or class is `Final` (a C static; any other module
  name is a dictionary lookup on every read); one that is meant to be replaced at run time
  (a test lowers it) says so with a plain annotation (`FLUSH_BYTES: int = ...`);
- no Generic classes and no weak references;
- tests do not monkeypatch compiled classes;
- every compiled module says so: its docstring begins with `(compiled)`, and no other does.

Attributes added to a compiled object from outside fail at run time in the compiled lane (native
classes have no `__dict__`); that rule has no static check here.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.native import MODULES, sources
from tests.support import ROOT

MARK = "(compiled)"  # how a compiled module's docstring begins
_WAITS = (ast.Await, ast.AsyncFor, ast.AsyncWith)
# Async context managers whose __aexit__ never suspends (it awaits nothing): CPython 3.11's
# asyncio.Timeout only cancels its handle and maps the cancellation.
NEVER_SUSPENDS = frozenset({"asyncio.timeout", "asyncio.timeout_at"})
COMPILED = dict(zip(MODULES, sources(ROOT), strict=True))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def waits_in_handlers(tree: ast.AST) -> list[int]:
    """Lines of the `except` and `finally` blocks in `tree` that wait."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try | ast.TryStar):
            continue
        blocks = [h.body for h in node.handlers] + [node.finalbody]
        for body in blocks:
            if any(isinstance(n, _WAITS) for stmt in body for n in ast.walk(stmt)):
                lines.append(body[0].lineno)
    return lines


def suspending_async_with(tree: ast.AST) -> list[int]:
    """Lines of `async with` on a manager not known never to suspend on exit."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncWith):
            for item in node.items:
                expr = item.context_expr
                name = ast.unparse(expr.func if isinstance(expr, ast.Call) else expr)
                if name not in NEVER_SUSPENDS:
                    lines.append(node.lineno)
    return lines


def async_generators(tree: ast.AST) -> list[int]:
    lines = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.AsyncFunctionDef):
            inner = [n for stmt in fn.body for n in ast.walk(stmt)]
            nested = {
                id(m)
                for n in inner
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                for m in ast.walk(n)
            }
            if any(isinstance(n, ast.Yield | ast.YieldFrom) and id(n) not in nested for n in inner):
                lines.append(fn.lineno)
    return lines


def _literal(value: ast.expr) -> bool:
    if isinstance(value, ast.Constant):
        return True
    if isinstance(value, ast.UnaryOp) and isinstance(value.operand, ast.Constant):
        return True
    return isinstance(value, ast.Tuple) and all(_literal(e) for e in value.elts)


_NOT_NATIVE_BASES = ("Enum", "NamedTuple", "Protocol", "TypedDict")


def built_class_defaults(tree: ast.AST) -> list[int]:
    """Lines of class attributes whose default is built (a call, a list, a name), outside
    dataclasses (their generated `__init__` sets fields), enums, named tuples and protocols."""
    lines = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        if any(ast.unparse(d).split("(")[0].endswith("dataclass") for d in cls.decorator_list):
            continue
        if any(ast.unparse(b).split("[")[0].endswith(_NOT_NATIVE_BASES) for b in cls.bases):
            continue
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                if "ClassVar" in ast.unparse(stmt.annotation) or _literal(stmt.value):
                    continue
                lines.append(stmt.lineno)
            elif isinstance(stmt, ast.Assign):
                names = [ast.unparse(t) for t in stmt.targets]
                if names != ["__slots__"] and not _literal(stmt.value):
                    lines.append(stmt.lineno)
    return lines


def _narrowed(test: ast.expr) -> list[str]:
    """The attribute chains (`self.conn`) a condition narrows: `x is (not) None`,
    `isinstance(x, T)`, a bare `x`, `not x`, and each side of `and` / `or`."""
    if isinstance(test, ast.BoolOp):
        return [c for v in test.values for c in _narrowed(v)]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _narrowed(test.operand)
    if isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.Is | ast.IsNot):
        return _narrowed(test.left)
    if isinstance(test, ast.Call) and getattr(test.func, "id", "") == "isinstance" and test.args:
        return _narrowed(test.args[0])
    return [ast.unparse(test)] if isinstance(test, ast.Attribute) else []


def _reads(node: ast.AST, chain: str) -> bool:
    """`chain` read through (`chain.x`, `chain[...]`, `chain(...)`) in `node`."""
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute | ast.Subscript) and ast.unparse(n.value) == chain:
            return True
        if isinstance(n, ast.Call) and ast.unparse(n.func) == chain:
            return True
    return False


def _sets(node: ast.AST, chain: str) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, ast.AnnAssign | ast.AugAssign):
            targets = [n.target]
        else:
            continue
        if any(ast.unparse(t) == chain for t in targets):
            return True
    return False


def _waits(node: ast.AST) -> bool:
    return any(isinstance(n, _WAITS) for n in ast.walk(node))


def _read_after_wait(block: list[ast.stmt], chain: str) -> int | None:
    waited = False
    for stmt in block:
        if waited and _reads(stmt, chain):
            return stmt.lineno
        if _sets(stmt, chain):
            return None
        waited = waited or _waits(stmt)
    return None


def narrowed_across_await(tree: ast.AST) -> list[int]:
    """Lines that read an attribute narrowed before an `await` of the same block: inside
    `if <narrowing>:`, or after `if <narrowing>: return` (raise, continue, break)."""
    lines = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.If | ast.While):
                for chain in _narrowed(node.test):
                    line = _read_after_wait(node.body, chain)
                    if line is not None:
                        lines.add(line)
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if not isinstance(block, list):
                    continue
                for k, stmt in enumerate(block):
                    exits = ast.Return | ast.Raise | ast.Continue | ast.Break
                    if isinstance(stmt, ast.If) and isinstance(stmt.body[-1], exits):
                        for chain in _narrowed(stmt.test):
                            line = _read_after_wait(block[k + 1 :], chain)
                            if line is not None:
                                lines.add(line)
    return sorted(lines)


def sums_without_start(tree: ast.AST) -> list[int]:
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and getattr(n.func, "id", "") == "sum"
        and len(n.args) < 2
        and not n.keywords
    ]


def constants_not_final(tree: ast.AST) -> list[int]:
    """Module-level `NAME = value` (assigned once, never `global`) whose name a function or
    class of the module reads; type aliases and TypeVars aside."""
    assert isinstance(tree, ast.Module)
    rebound = {name for n in ast.walk(tree) if isinstance(n, ast.Global) for name in n.names}
    times: dict[str, int] = {}
    for n in tree.body:
        if isinstance(n, ast.Assign | ast.AnnAssign):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Name):
                    times[t.id] = times.get(t.id, 0) + 1
    read = {
        x.id
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for x in ast.walk(n)
        if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)
    }
    lines = []
    for n in tree.body:
        if not (isinstance(n, ast.Assign) and len(n.targets) == 1):
            continue
        t, v = n.targets[0], n.value
        if not isinstance(t, ast.Name) or t.id.startswith("__"):
            continue
        if t.id in rebound or times[t.id] > 1 or t.id not in read:
            continue
        if isinstance(v, ast.Call) and ast.unparse(v.func).split(".")[-1] == "TypeVar":
            continue
        if isinstance(v, ast.Subscript | ast.BinOp) and not t.id.isupper() and t.id[:1].isupper():
            continue  # a type alias (`Ok = Callable[[Any], bool]`)
        lines.append(n.lineno)
    return lines


def generics_and_weakrefs(tree: ast.AST) -> list[int]:
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef) and (
            getattr(n, "type_params", None)
            or any(ast.unparse(b).split("[")[0].endswith("Generic") for b in n.bases)
        ):
            lines.append(n.lineno)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            names = [a.name for a in n.names] + [getattr(n, "module", None) or ""]
            if any(name.split(".")[0] == "weakref" for name in names):
                lines.append(n.lineno)
    return lines


def bytes_needles(tree: ast.AST) -> list[int]:
    """Lines of `b"x" in data` (a one-byte string looked for with `in`): CPython first reads the
    needle as an integer, and the TypeError it raises and clears costs ~6× the search. Ask for
    the byte's value (`0x0A in data`)."""
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Compare)
        and isinstance(n.ops[0], ast.In | ast.NotIn)
        and isinstance(n.left, ast.Constant)
        and isinstance(n.left.value, bytes)
        and len(n.left.value) == 1
    ]


RULES = {
    "an await in except/finally": waits_in_handlers,
    "async with on a manager whose exit may suspend": suspending_async_with,
    "an async generator": async_generators,
    "a built class default": built_class_defaults,
    "an attribute narrowed across an await": narrowed_across_await,
    "a sum without its start": sums_without_start,
    "a module constant read in a function, not Final": constants_not_final,
    "a Generic class or a weak reference": generics_and_weakrefs,
    "a one-byte string looked for with `in`": bytes_needles,
}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_module_keeps_the_rule(module: str, rule: str) -> None:
    path = COMPILED[module]
    where = RULES[rule](_tree(path))
    assert not where, f"{path.relative_to(ROOT)}: {rule} at lines {where}"


def test_compiled_modules_say_so_and_no_other_does() -> None:
    marked = set()
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        doc = ast.get_docstring(_tree(path), clean=False) or ""
        if doc.startswith(MARK):
            marked.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert marked == set(MODULES)


def _compiled_classes() -> set[str]:
    return {
        f"{module}.{n.name}"
        for module, path in COMPILED.items()
        for n in _tree(path).body
        if isinstance(n, ast.ClassDef)
    }


def patched_compiled_classes(tree: ast.AST, classes: set[str]) -> list[int]:
    """Lines of `monkeypatch.setattr` on a class of a compiled module (by name imported from
    it, or by dotted path)."""
    local: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            for a in n.names:
                local[a.asname or a.name] = f"{n.module}.{a.name}"
    lines = []
    for n in ast.walk(tree):
        if not (
            isinstance(n, ast.Call)
            and ast.unparse(n.func).endswith("monkeypatch.setattr")
            and n.args
        ):
            continue
        target = n.args[0]
        if (
            isinstance(target, ast.Name)
            and local.get(target.id) in classes
            or (
                isinstance(target, ast.Constant)
                and isinstance(target.value, str)
                and target.value.rpartition(".")[0] in classes
            )
        ):
            lines.append(n.lineno)
    return lines


def test_tests_do_not_monkeypatch_compiled_classes() -> None:
    classes = _compiled_classes()
    wrong = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line in patched_compiled_classes(_tree(path), classes)
    ]
    assert not wrong, f"monkeypatched compiled classes: {wrong}"


# Each check finds what it is for: (check, source, the lines it must report).
EXAMPLES = [
    (waits_in_handlers, "async def f():\n try:\n  pass\n except OSError:\n  await g()\n", [5]),
    (
        waits_in_handlers,
        "async def f():\n try:\n  pass\n finally:\n  async with g():\n   pass\n",
        [5],
    ),
    (
        suspending_async_with,
        "async def f(lock, d):\n async with asyncio.timeout(d):\n  pass\n async with lock:\n"
        "  pass\n async with asyncio.timeout_at(d), g():\n  pass\n",
        [4, 6],
    ),
    (async_generators, "async def f():\n yield 1\nasync def g():\n def h():\n  yield 2\n", [1]),
    (
        built_class_defaults,
        "class A:\n __slots__ = ('x',)\n n: int = 0\n t = ()\n b: list[int] = []\n c = f()\n"
        "@dataclass\nclass D:\n x: list[int] = field(default_factory=list)\n"
        "class E(enum.Enum):\n A = enum.auto()\n",
        [5, 6],
    ),
    (
        narrowed_across_await,
        "async def f(self):\n if self.conn is not None:\n  await g()\n  self.conn.write()\n"
        " if self.a is None:\n  return\n await g()\n self.a.go()\n"
        " if self.b:\n  self.b = await make()\n  self.b.go()\n",
        [4, 8],
    ),
    (sums_without_start, "a = sum(x)\nb = sum((m.w for m in ms), 0.0)\nc = sum(x, start=0)\n", [1]),
    (
        constants_not_final,
        "A = 1\nB: Final = 2\nC: int = 3\nD = 4\nOk = Callable[[Any], bool]\nE = 5\nE = 6\n"
        "def f():\n return A + B + C + E + Ok\n",
        [1],
    ),
    (
        generics_and_weakrefs,
        "import weakref\nclass A(Generic[T]):\n pass\nclass B(Base):\n pass\n",
        [1, 2],
    ),
    (
        bytes_needles,
        'a = b"\\n" in x\nb = 0x0A in x\nc = b"ab" in x\nd = b"\\r" not in x\ne = x in b"ab"\n',
        [1, 4],
    ),
]


@pytest.mark.parametrize(("check", "src", "lines"), EXAMPLES)
def test_the_check_finds_one(
    check: Callable[[ast.AST], list[int]], src: str, lines: list[int]
) -> None:
    assert check(ast.parse(src)) == lines


def test_the_monkeypatch_check_finds_one() -> None:
    src = (
        "from gateway.forward.http import HttpForward\n"
        "def test(monkeypatch):\n    monkeypatch.setattr(HttpForward, 'serve', f)\n"
        "    monkeypatch.setattr('gateway.forward.http.HttpForward.serve', f)\n"
        "    monkeypatch.setattr(accesslog, 'FLUSH_BYTES', 10)\n"
    )
    found = patched_compiled_classes(ast.parse(src), {"gateway.forward.http.HttpForward"})
    assert found == [3, 4]
