"""The JSON Schema editors get: a valid 2020-12 schema, every field described, defaults and
examples present, and every shipped policy valid against it (checked with `jsonschema`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.policy.schema import policy_schema
from tests.policyctl.test_commands import SHIPPED

jsonschema = pytest.importorskip("jsonschema")


def validator() -> Any:
    schema = policy_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)  # the schema itself is valid for its dialect
    return cls(schema)


def properties(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    out = [("Policy", k, v) for k, v in schema["properties"].items()]
    for name, node in schema["$defs"].items():
        out += [(name, k, v) for k, v in node.get("properties", {}).items()]
    return out


def test_schema_is_valid_2020_12() -> None:
    schema = policy_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    validator()


def test_every_field_is_described_and_has_its_default() -> None:
    schema = policy_schema()
    missing = [f"{m}.{k}" for m, k, v in properties(schema) if not v.get("description")]
    assert not missing, missing
    required = {
        (m, k)
        for m, node in [("Policy", schema), *schema["$defs"].items()]
        for k in node.get("required", [])
    }
    no_default = [
        f"{m}.{k}"
        for m, k, v in properties(schema)
        if (m, k) not in required and "default" not in v
    ]
    assert not no_default, no_default
    # Defaults pydantic leaves out (default_factory) are filled in.
    assert schema["$defs"]["Rollout"]["properties"]["stages"]["default"] == [
        "shadow",
        5.0,
        25.0,
        100.0,
    ]
    assert schema["properties"]["timeouts"]["default"]["first_byte_s"] == 30.0


def test_examples_are_present_and_valid() -> None:
    schema = policy_schema()
    v = validator()
    for example in schema["examples"]:
        v.validate(example)
    with_examples = [(m, k) for m, k, p in properties(schema) if p.get("examples")]
    assert ("Endpoint", "address") in with_examples and ("Route", "timeouts") in with_examples
    assert len(with_examples) >= 15


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_policy_validates_against_the_schema(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    errors = [e.message for e in validator().iter_errors(doc)]
    assert not errors, errors


def test_the_schema_refuses_what_the_loader_refuses() -> None:
    v = validator()
    bad = {"routes": [{"name": "r", "backend": "a", "timeout": {"first_byte_s": 1}}]}
    assert any("timeout" in e.message for e in v.iter_errors(bad))
    assert list(v.iter_errors({"rollout": {"stages": [5, 100], "hold_s": -1}}))
