"""README.md is the front page: short, and every file it links to exists (the docs site's own
links are checked by `mkdocs build --strict` in `make test`)."""

from __future__ import annotations

import re

from tests.support import ROOT

README = ROOT / "README.md"


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert lines[0] == "# Sluice"
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_every_relative_link_of_the_readme_exists() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    assert local, "the README links to no page of the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == [], missing


def test_every_docs_page_is_linked_from_the_readme() -> None:
    text = README.read_text()
    pages = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
    unlinked = [p for p in pages if f"]({p})" not in text]
    assert unlinked == [], f"the README's map of the docs leaves out {unlinked}"
