"""The `admission:` section: the shape of the issue's example validates as written, defaults are
documented, bad values point at their line and column."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.policy.loader import load_policy
from tests.policy.test_loader import errors_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "policies" / "examples" / "fair-admission.yaml"

BASE = """\
backends:
  - name: vllm
    endpoints: [{address: "127.0.0.1:9000"}]
    max_in_flight: 8
routes:
  - name: r
    match: {protocol: http}
    backend: vllm
"""


def test_the_example_validates_as_written() -> None:
    p = load_policy(EXAMPLE)
    a = p.admission
    assert a is not None and p.backends[0].max_in_flight == 8
    assert a.queue.max_wait_ms == 5000 and a.queue.max_queued == 2000
    assert a.fairness.key == ["claim:tenant"]
    assert (a.fairness.cost.input, a.fairness.cost.output) == (1.0, 2.0)
    assert a.fairness.weights is not None and a.fairness.weights.source == "claim:weight"
    assert a.priority is not None and a.priority.ceiling.classes == {"gold": 0, "silver": 1,
                                                                     "free": 2}  # fmt: skip
    assert a.deadline is not None and a.deadline.header == "x-sluice-deadline-ms"
    assert p.filters.index("admission") == p.filters.index("route") - 1  # in the default chain


def test_an_empty_section_takes_the_documented_defaults(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE + "admission: {}\n")
    a = load_policy(path).admission
    assert a is not None and a.queue.max_wait_ms == 5000 and a.priority is None
    assert a.fairness.weights is None and a.deadline is None
    assert a.queue.anticipate_ms == 20.0  # a light tenant keeps its turn by default


CLASSES = "ceiling: {from: claim:tier, classes: {gold: 0, silver: 1, free: 2}, default: 2}"


@pytest.mark.parametrize(("reserve", "rank"), [
    ("{share: 0.25, rank: gold}", 0),
    ("{share: 0.25, rank: silver}", 1),
    ("{share: 0.5, rank: 1}", 1),
    ("{share: 0.5}", 0),
])  # fmt: skip
def test_the_optional_anticipation_and_reserve_validate(tmp_path: Path, reserve: str,
                                                         rank: int) -> None:  # fmt: skip
    path = tmp_path / "p.yaml"
    path.write_text(BASE + "admission:\n  queue: {anticipate_ms: 20}\n"
                    f"  priority: {{{CLASSES}, reserve: {reserve}}}\n")  # fmt: skip
    a = load_policy(path).admission
    assert a is not None and a.queue.anticipate_ms == 20 and a.priority is not None
    assert a.priority.reserve is not None and a.priority.reserve_rank() == rank


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ("admission: {queue: {max_wait_ms: 0}}\n", "9:34: admission.queue.max_wait_ms"),
        (
            "admission: {queue: {max_queued: 10, extra: 1}}\n",
            "9:37: admission.queue.extra: unknown",
        ),
        ("admission: {fairness: {key: [claim:tenant, nope]}}\n", "9:44: admission.fairness.key[1]"),
        (
            "admission: {fairness: {weights: {from: claim:w, default: -1}}}\n",
            "9:58: admission.fairness.weights.default",
        ),
        ("admission: {priority: {header: x-p}}\n", "9:23: admission.priority.ceiling: required"),
        ("admission: {queue: {anticipate_ms: -1}}\n", "9:36: admission.queue.anticipate_ms"),
        (
            f"admission: {{priority: {{{CLASSES}, reserve: {{share: 0}}}}}}\n",
            "9:122: admission.priority.reserve.share",
        ),
        (
            f"admission: {{priority: {{{CLASSES}, reserve: {{share: 0.2, rank: bronze}}}}}}\n",
            "9:23: admission.priority: reserve.rank 'bronze' is not one of",
        ),
        (
            "admission: {}\nfilters: [request_id, route]\n",
            "10:10: filters: admission is configured",
        ),
        (
            "admission: {}\nfilters: [route, admission]\n",
            "10:10: filters: 'admission' must come before",
        ),
    ],
)
def test_bad_input_points_at_the_node(tmp_path: Path, tail: str, expected: str) -> None:
    errors = errors_of(tmp_path, BASE + tail)
    assert any(e.startswith(expected) for e in errors), errors


def test_max_in_flight_is_positive(tmp_path: Path) -> None:
    errors = errors_of(tmp_path, BASE.replace("max_in_flight: 8", "max_in_flight: 0"))
    assert errors[0].startswith("4:20: "), errors
