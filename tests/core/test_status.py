"""The gateway colour roll-up (gateway.core.status): table-driven over state documents."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core.status import backend_colour, deltas, member_colour, rollup, worst


def _backend(*members: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": "b", "members": list(members), **extra}


@pytest.mark.parametrize(
    ("member", "colour"),
    [
        ({"address": "a"}, "green"),
        ({"address": "a", "healthy": True, "breaker": "closed"}, "green"),
        ({"address": "a", "healthy": False}, "red"),
        ({"address": "a", "ejected": True}, "red"),
        ({"address": "a", "breaker": "open"}, "red"),
        ({"address": "a", "breaker": "half_open"}, "yellow"),
        ({"address": "a", "channel": "TRANSIENT_FAILURE"}, "red"),
        ({"address": "a", "channel": "IDLE"}, "green"),
        ({"address": "a", "colour": "yellow"}, "yellow"),  # a feature's own colour is kept
        ({"address": "a", "colour": "green", "healthy": False}, "red"),  # ... unless worse
        # The detectors' own snapshots, as the backends owner nests them:
        ({"address": "a", "health": {"healthy": False, "last_error": "refused"}}, "red"),
        ({"address": "a", "health": {"healthy": True}}, "green"),
        ({"address": "a", "breaker": {"state": "open", "reopens": 2}}, "red"),
        ({"address": "a", "breaker": {"state": "half_open"}}, "yellow"),
        ({"address": "a", "outlier": {"ejections": 1, "ejected_for_s": 4.5}}, "red"),
        ({"address": "a", "outlier": {"ejections": 1}}, "green"),
    ],
)
def test_member_colour(member: dict[str, Any], colour: str) -> None:
    assert member_colour(member) == colour


@pytest.mark.parametrize(
    ("backend", "colour", "reason"),
    [
        (_backend({"address": "a"}, {"address": "b"}), "green", None),
        (_backend({"address": "a", "healthy": False}, {"address": "b"}), "yellow", "1 of 2"),
        (_backend({"address": "a", "healthy": False}), "red", "no usable member"),
        (_backend({"address": "a"}, recent_errors=3), "yellow", "3 upstream errors"),
        (_backend({"address": "a"}, colour="red"), "red", "backend b: red"),
        (_backend(), "green", None),
    ],
)
def test_backend_colour(backend: dict[str, Any], colour: str, reason: str | None) -> None:
    got, reasons = backend_colour(backend)
    assert got == colour
    if reason is None:
        assert reasons == []
    else:
        assert any(reason in r for r in reasons), reasons


def test_rollup_is_the_worst_and_lists_reasons_worst_first() -> None:
    doc = {
        "gateway": {"state": "ready"},
        "policy": {"version": "v1", "last_reload": {"ok": False}},
        "backends": {"backends": [_backend({"address": "a", "healthy": False})]},
        "limits": {"colour": "yellow"},
        "datapath": {"state": "off"},
    }
    colour, reasons = rollup(doc)
    assert colour == "red"
    assert "no usable member" in reasons[0]
    assert any("policy reload rejected; v1 keeps serving" in r for r in reasons)
    assert "limits: yellow" in reasons


@pytest.mark.parametrize(
    ("doc", "colour"),
    [
        ({"gateway": {"state": "ready"}}, "green"),
        ({"gateway": {"state": "starting"}}, "yellow"),
        ({"gateway": {"state": "draining"}}, "yellow"),
        ({"datapath": {"state": "unavailable", "error": "no bcc"}}, "yellow"),
        ({"datapath": {"state": "attached"}}, "green"),
        ({"rollout": {"colour": "red", "stage": "canary"}}, "red"),
        ({"limits": {"colour": "purple"}}, "purple"),  # unknown: ranked yellow, not hidden
        ({"limits": {"colour": "grey"}}, "green"),
    ],
)
def test_rollup_rules(doc: dict[str, Any], colour: str) -> None:
    assert rollup(doc)[0] == colour


def test_worst_and_deltas() -> None:
    assert worst(["green", "red", "yellow"]) == "red"
    assert worst([]) == "green"
    assert worst([None, "grey"]) == "green"
    assert deltas({"a": 5, "b": 2, "c": 1}, {"a": 3, "b": 2, "c": 4}) == {"a": 2, "c": 1}
