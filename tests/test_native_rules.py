"""A rule the compiled request path (`gateway.native`) must keep: no `await` (nor `async for`,
`async with`) inside an `except` or `finally` block of a compiled module. mypyc keeps one
exception state per thread, not per coroutine, so such a block restores, when it ends, a state
saved while an exception was thrown into the task, and that exception is raised again later:
a failed backend TLS handshake was answered 502 and then raised out of the request
(`tests/integration/test_upstream_tls.py` shows it end to end)."""

from __future__ import annotations

import ast

import pytest

from gateway.native import MODULES, sources
from tests.support import ROOT

_WAITS = (ast.Await, ast.AsyncFor, ast.AsyncWith)


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


@pytest.mark.parametrize("path", sources(ROOT), ids=list(MODULES))
def test_no_await_in_except_or_finally(path) -> None:
    where = waits_in_handlers(ast.parse(path.read_text(), str(path)))
    assert not where, f"{path.relative_to(ROOT)}: an await in except/finally at lines {where}"


def test_the_check_finds_one() -> None:
    src = "async def f():\n    try:\n        pass\n    except OSError:\n        await g()\n"
    assert waits_in_handlers(ast.parse(src)) == [5]
    src = (
        "async def f():\n    try:\n        pass\n    finally:\n"
        "        async with g():\n            pass\n"
    )
    assert waits_in_handlers(ast.parse(src)) == [5]
