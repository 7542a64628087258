"""gateway/core is pure: it may import the standard library and gateway.core, nothing else.

Walks the AST (no import is executed), so a forbidden import is caught even inside a function or
an `if TYPE_CHECKING:` block.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "gateway" / "core"
ALLOWED_STDLIB = sys.stdlib_module_names | {"__future__"}


def imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `tree`; relative ones are resolved."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
        ):
            found.append((node.lineno, "<dynamic import_module>"))
    return found


def allowed(module: str) -> bool:
    top = module.split(".")[0]
    return top in ALLOWED_STDLIB or module == "gateway.core" or module.startswith("gateway.core.")


CORE_FILES = sorted(CORE.glob("*.py"))


def test_core_has_modules() -> None:
    assert CORE_FILES, f"no modules found under {CORE}"


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_imports_only_stdlib_and_core(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [
        f"{path.name}:{line}: {name}"
        for line, name in imported_modules(tree, "gateway.core")
        if not allowed(name)
    ]
    assert not bad, "gateway/core must stay pure (stdlib + gateway.core only):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "ok"),
    [
        ("import os", True),
        ("from collections.abc import Sequence", True),
        ("from gateway.core.clock import Clock", True),
        ("from . import clock", True),
        ("from .verdict import Verdict", True),
        ("import yaml", False),
        ("from gateway.policy import model", False),
        ("from .. import errors", False),
        ("def f():\n    import aiohttp", False),
        ("import importlib\nimportlib.import_module('redis')", False),
    ],
)
def test_checker_itself(source: str, ok: bool) -> None:
    names = [n for _, n in imported_modules(ast.parse(source), "gateway.core")]
    assert all(allowed(n) for n in names) is ok, names
