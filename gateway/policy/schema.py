"""The JSON Schema of the policy document, for editors (`sluice policy schema`,
policies/schema.json): pydantic's schema plus what an editor needs to complete and explain a
field that pydantic leaves out: the default of every field built by a `default_factory`, and
examples of the fields people type most (a field's own `examples=` wins).

Stable byte for byte (sorted keys), so the shipped file can be compared with the generated one.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from pydantic import BaseModel, TypeAdapter

from gateway.policy.diagnose import candidate_types
from gateway.policy.model import Policy

DIALECT = "https://json-schema.org/draft/2020-12/schema"

EXAMPLES: dict[tuple[str, str], list[Any]] = {
    ("Endpoint", "address"): ["10.0.0.11:8000", "[fd00::11]:8000", "vllm-0.vllm:8000"],
    ("Endpoint", "weight"): [3, 0],
    ("Backend", "name"): ["vllm", "triton"],
    ("Backend", "unary_methods"): [["/inference.GRPCInferenceService/ModelInfer"]],
    ("Route", "name"): ["openai", "triton"],
    ("Route", "backend"): ["vllm"],
    ("Route", "backends"): [
        [{"backend": "vllm", "weight": 95}, {"backend": "canary", "weight": 5}]
    ],
    ("Route", "timeouts"): [{"first_byte_s": 120, "total_s": 1800}],
    ("Route", "strip_prefix"): ["/triton"],
    ("RouteMatch", "path_prefix"): ["/v1/", "/inference.GRPCInferenceService/"],
    ("RouteMatch", "methods"): [["POST"]],
    ("RouteMatch", "headers"): [[{"name": "x-canary", "value": "1"}]],
    ("HeaderMatch", "name"): ["x-canary", "x-tenant"],
    ("Listener", "port"): [8080, 8081, 9901],
    ("GrpcListenerConfig", "port"): [8081],
    ("Timeouts", "first_byte_s"): [60],
    ("Timeouts", "total_s"): [600],
    ("Limits", "max_body_bytes"): [1048576],
}

ROOT_EXAMPLE: dict[str, Any] = {
    "version": 1,
    "backends": [{"name": "vllm", "endpoints": [{"address": "10.0.0.11:8000"}]}],
    "routes": [{"name": "openai", "match": {"path_prefix": "/v1/"}, "backend": "vllm"}],
    "rollout": {"stages": ["shadow", 5, 25, 100], "hold_s": 60},
}


def _models(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model reachable from `root`, by class name (the schema's $defs keys)."""
    out: dict[str, type[BaseModel]] = {}
    todo: list[Any] = [root]
    while todo:
        tp = todo.pop()
        for t in candidate_types(tp):
            if inspect.isclass(t) and issubclass(t, BaseModel):
                if t.__name__ in out:
                    continue
                out[t.__name__] = t
                todo += [f.annotation for f in t.model_fields.values()]
            else:
                todo += list(getattr(t, "__args__", ()))
    return out


def _enrich(node: dict[str, Any], model: type[BaseModel]) -> None:
    props = node.get("properties", {})
    for name, field in model.model_fields.items():
        prop = props.get(name)
        if prop is None:
            continue
        if "default" not in prop and field.default_factory is not None and field.annotation:
            value = field.default_factory()  # type: ignore[call-arg]
            prop["default"] = TypeAdapter(field.annotation).dump_python(value, mode="json")
        examples = EXAMPLES.get((model.__name__, name))
        if examples is not None and "examples" not in prop:
            prop["examples"] = examples


def policy_schema() -> dict[str, Any]:
    schema = Policy.model_json_schema()
    models = _models(Policy)
    for name, node in schema.get("$defs", {}).items():
        if name in models:
            _enrich(node, models[name])
    _enrich(schema, Policy)
    schema["$schema"] = DIALECT
    schema["title"] = "Sluice policy"
    schema["description"] = (
        "One policy document: listeners, limits, timeouts, backends, routes and the filter "
        "chain. Unknown fields are errors. `sluice policy check FILE` validates it."
    )
    schema["examples"] = [ROOT_EXAMPLE]
    return schema


def schema_text() -> str:
    return json.dumps(policy_schema(), sort_keys=True, indent=2) + "\n"
