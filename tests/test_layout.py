"""The layout rules of docs/contributing.md ("Layout and imports"), read from the sources: one
folder per ingress engine, no module importing across engine folders except through a folder's
face (its `__init__`), and every SSL context built in `gateway/tls/`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

GATEWAY = Path(__file__).resolve().parent.parent / "gateway"
ADAPTERS = GATEWAY / "adapters"
ENGINES = ("native", "aiohttp", "h2", "grpcio")
# What may sit flat in gateway/adapters/ besides the engine folders: the package's own face,
# the choice of engine, and what every HTTP engine writes alike.
FLAT = {"__init__.py", "engines.py", "common.py"}


def module_name(path: Path) -> str:
    parts = path.relative_to(GATEWAY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module a file imports, with its line: `from a.b import c` counts as `a.b` and, when
    `c` is a module of its own, as `a.b.c`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if GATEWAY.parent.joinpath(*sub.split(".")).with_suffix(".py").is_file():
                    found.append((node.lineno, sub))
    return found


def engine_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["gateway", "adapters"] and len(parts) > 2 and parts[2] in ENGINES:
        return parts[2]
    return None


def test_every_engine_is_a_folder_with_a_face() -> None:
    for engine in ENGINES:
        face = ADAPTERS / engine / "__init__.py"
        assert face.is_file(), f"{engine}: no face"
        tree = ast.parse(face.read_text())
        assert ast.get_docstring(tree), f"{face}: the face says what the engine is"
        assert any(
            isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
            for n in tree.body
        ), f"{face}: the face names what it offers (__all__)"
    flat = {p.name for p in ADAPTERS.glob("*.py")}
    assert flat <= FLAT, f"engine files left flat in gateway/adapters: {sorted(flat - FLAT)}"


def test_no_module_imports_across_engine_folders_but_through_a_face() -> None:
    wrong = []
    for path in sorted(GATEWAY.rglob("*.py")):
        here = module_name(path)
        own = engine_of(here)
        for line, target in imported(ast.parse(path.read_text(), str(path))):
            other = engine_of(target)
            if other is None or other == own:
                continue
            if target != f"gateway.adapters.{other}":  # a module behind the face
                wrong.append(f"{path.relative_to(GATEWAY.parent)}:{line}: imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_crossing() -> None:
    tree = ast.parse("from gateway.adapters.h2 import guard\nimport gateway.adapters.native.conn\n")
    targets = [t for _, t in imported(tree)]
    assert "gateway.adapters.h2.guard" in targets
    assert "gateway.adapters.native.conn" in targets
    assert engine_of("gateway.adapters.h2.guard") == "h2"
    assert engine_of("gateway.adapters.engines") is None


# What builds an SSL context (or grpc's TLS credentials, its equivalent).
BUILDS_CONTEXT = re.compile(
    r"create_default_context\(|SSLContext\(|ssl_(server|channel)_credentials\(|"
    r"dynamic_ssl_server_credentials\("
)


def builds_context(text: str) -> list[int]:
    """Lines of `text` that build an SSL context (comments and docstrings aside)."""
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if BUILDS_CONTEXT.search(code) and not code.lstrip().startswith(("`", '"')):
            lines.append(number)
    return lines


def test_every_ssl_context_is_built_in_gateway_tls() -> None:
    tls = GATEWAY / "tls"
    wrong = [
        f"{path.relative_to(GATEWAY.parent)}:{line}"
        for path in sorted(GATEWAY.rglob("*.py"))
        if tls not in path.parents
        for line in builds_context(path.read_text())
    ]
    assert not wrong, f"SSL contexts built outside gateway/tls: {wrong}"
    assert builds_context((tls / "material.py").read_text()), "the check finds nothing at all"


def test_the_context_check_sees_one() -> None:
    assert builds_context("ctx = ssl.create_default_context()\n") == [1]
    assert builds_context("x = 1\nctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)\n") == [2]
    assert builds_context("# not ssl.create_default_context(): it trusts the system CAs\n") == []


# A document outside the repository, or a rule by its number: comments say the thing itself,
# or name a section of docs/contributing.md ("Comments" there).
CITATION = re.compile(r"\.\./shared|shared/reference|\bSTYLE\b|STYLE\.md|\bDESIGN\b|\brule \d+")


def citations(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1) if CITATION.search(line)]


def test_no_comment_cites_a_document_outside_the_repository() -> None:
    wrong = [
        f"{path.relative_to(GATEWAY.parent)}:{line}"
        for path in sorted(GATEWAY.rglob("*.py"))
        for line in citations(path.read_text())
    ]
    assert not wrong, f"citations of documents outside the repository: {wrong}"


def test_the_citation_check_sees_one() -> None:
    assert citations("x = 1  # see ../shared/reference/http2-tls.md\n") == [1]
    assert citations('"""The loop (STYLE rule 19)."""\n') == [1]
    assert citations("# (DESIGN.md, 'The hot path')\n# (DESIGN: --workers)\n") == [1, 2]
    assert citations("# the compiled-path rules in docs/contributing.md\n") == []
