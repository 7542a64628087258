"""The policy reference page (docs/reference/policy.md) is what `sluice policy docs` renders from
the policy schema: committed and current, complete, and a function of the schema."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

from gateway.policy.reference import REGENERATE, reference_text
from gateway.policy.schema import policy_schema
from tests.support import ROOT

PAGE = ROOT / "docs" / "reference" / "policy.md"


def sections(page: str) -> dict[str, str]:
    """Each model's section of the page, by model name (`### Name {#anchor}`)."""
    parts = re.split(r"^### (\w+) \{#\w+\}$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_committed_page_is_current() -> None:
    assert PAGE.read_text() == reference_text(), (
        f"docs/reference/policy.md is stale: regenerate it with `{REGENERATE}`"
    )


def test_the_command_prints_the_page() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "policy", "docs"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == reference_text()


def test_every_section_and_field_is_on_the_page() -> None:
    schema = policy_schema()
    page = reference_text(schema)
    found = sections(page)
    assert sorted(found) == sorted(schema["$defs"])
    top = page[page.index("## The document") : page.index("\n## `")]
    assert [f for f in schema["properties"] if f"| `{f}` |" not in top] == []
    for model, node in schema["$defs"].items():
        rows = [f for f in node.get("properties", {}) if f"\n| `{f}` |" not in found[model]]
        assert rows == [], f"{model}: fields missing from its table: {rows}"


def test_a_default_a_bound_and_a_description_reach_the_page() -> None:
    page = sections(reference_text())["Timeouts"]
    row = next(line for line in page.splitlines() if line.startswith("| `connect_s` |"))
    assert row == "| `connect_s` | number | `2.0` | TCP connect to a backend (504). Bounds: > 0. |"
    required = sections(reference_text())["Listener"]
    assert "| `port` | integer | required | port to bind; 0 picks a free one. Bounds: from 0 to" \
        in required  # fmt: skip


def test_a_change_to_the_schema_changes_the_page() -> None:
    schema = copy.deepcopy(policy_schema())
    field = schema["$defs"]["Timeouts"]["properties"]["connect_s"]
    field["default"] = 3.5
    field["description"] = "a new description"
    page = reference_text(schema)
    assert page != reference_text()
    assert "| `connect_s` | number | `3.5` | a new description. Bounds: > 0. |" in page


def test_links_between_sections_name_existing_anchors() -> None:
    page = reference_text()
    anchors = set(re.findall(r"\{#(\w+)\}", page))
    linked = set(re.findall(r"\]\(#(\w+)\)", page))
    assert linked and linked <= anchors, linked - anchors
