"""The `tracing:` section: the issue's YAML works as written, bad values point at their line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import PolicyError
from gateway.filters.registry import build_chain
from gateway.filters.trace import GenAITraceFilter, TraceFilter
from gateway.policy.compiled import compile_policy
from gateway.policy.loader import load_policy, load_policy_text
from gateway.policy.model import DEFAULT_FILTERS, TracingExporter
from gateway.services import Services
from gateway.telemetry.tracing import resolve_protocol
from tests.support import ROOT

BASE = """\
version: 1
backends:
  - name: a
    endpoints: [{address: "127.0.0.1:1"}]
routes:
  - name: r
    backend: a
"""

ISSUE = """\
tracing:
  enabled: true
  sample_ratio: 1.0e-5        # of the traces that are neither errors nor slow
  slow_ms: 2000               # slower than this is always kept
  service_name: sluice-edge
"""


def test_the_issue_yaml_validates_and_builds_the_filter() -> None:
    p = load_policy_text(BASE + ISSUE)
    assert p.tracing.enabled and p.tracing.sample_ratio == 1e-5
    assert p.tracing.slow_ms == 2000 and p.tracing.service_name == "sluice-edge"
    assert list(DEFAULT_FILTERS[:2]) == ["request_id", "trace"]
    services = Services()
    chain = build_chain(compile_policy(p), services)
    (f,) = [f for f in chain.filters if isinstance(f, TraceFilter)]
    assert type(f) is TraceFilter  # no body/event hooks: nothing parsed for it
    assert [x.name for x in chain.filters][:2] == ["request_id", "trace"]
    assert f.sampler.threshold == (1 << 64) // 100_000


def test_the_example_file_validates() -> None:
    p = load_policy(ROOT / "policies" / "examples" / "tracing.yaml")
    assert p.tracing.enabled and p.tracing.service_name == "sluice-edge"


def test_genai_attributes_add_the_body_and_event_hooks() -> None:
    p = load_policy_text(BASE + ISSUE + "  genai_attributes: true\n")
    chain = build_chain(compile_policy(p), Services())
    assert any(isinstance(f, GenAITraceFilter) for f in chain.filters)
    assert chain.has_body and chain.has_events


def test_listing_filters_without_trace_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE + "filters: [request_id, route]\n" + ISSUE)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    assert e.value.errors == [f"{path}:8:10: filters: tracing is enabled: list 'trace' in filters"]


@pytest.mark.parametrize(
    ("line", "where"),
    [
        ("  sample_ratio: 1.5\n", "tracing.sample_ratio"),
        ("  max_pending_traces: 0\n", "tracing.max_pending_traces"),
        ("  exporter: {protocol: http/json}\n", "tracing.exporter.protocol"),
        ("  sampling: 1\n", "tracing.sampling"),
    ],
)
def test_bad_values_point_at_their_line(line: str, where: str, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE + "tracing:\n  enabled: true\n" + line)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    assert e.value.errors[0].startswith(f"{path}:10:"), e.value.errors
    assert where in e.value.errors[0]


def test_protocol_comes_from_the_policy_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    assert resolve_protocol(TracingExporter()) == "http/protobuf"  # the OTLP default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert resolve_protocol(TracingExporter()) == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert resolve_protocol(TracingExporter()) == "http/protobuf"  # the per-signal one wins
    assert resolve_protocol(TracingExporter(protocol="grpc")) == "grpc"  # the policy wins
