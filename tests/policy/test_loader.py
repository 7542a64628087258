"""Loader: every rejected document yields `PATH:LINE:COL: message` lines pointing at the node."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import PolicyError
from gateway.policy.loader import MAX_BYTES, MAX_NODES, load_policy, load_policy_text
from gateway.policy.model import Policy

GOOD = """\
version: 1
backends:
  - name: a
    endpoints:
      - address: 127.0.0.1:9000
  - name: g
    protocol: grpc
    endpoints:
      - address: 127.0.0.1:9001
routes:
  - name: r
    match: {protocol: http}
    backend: a
"""


def errors_of(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    prefix = f"{path}:"
    assert all(line.startswith(prefix) for line in info.value.errors), info.value.errors
    return [line[len(prefix) :] for line in info.value.errors]


def test_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    policy = load_policy(path)
    assert isinstance(policy, Policy)
    assert [b.name for b in policy.backends] == ["a", "g"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "timeouts:\n  connect_s: fast\n",
            "2:14: timeouts.connect_s: Input should be a valid number",
            id="bad-type",
        ),
        pytest.param(
            "timeouts:\n  connect_s: 1\n  conect_s: 2\n",
            "3:3: timeouts.conect_s: unknown field",
            id="unknown-field",
        ),
        pytest.param(
            "listeners:\n  http:\n    host: 0.0.0.0\n",
            "3:5: listeners.http.port: required field is missing",
            id="missing-field",
        ),
        pytest.param(
            GOOD.replace("    backend: a\n", "    backend: x\n"),
            "13:14: routes[0].backend: unknown backend 'x' (known: a, g)",
            id="unknown-backend",
        ),
        pytest.param(
            GOOD + "  - name: s\n    backends:\n      - backend: a\n      - backend: nope\n",
            "17:18: routes[1].backends[1].backend: unknown backend 'nope'",
            id="unknown-backend-in-split",
        ),
        pytest.param(
            GOOD + "  - name: m\n    backends: [{backend: a}, {backend: g}]\n",
            "15:15: routes[1].backends: a route cannot mix http and grpc backends",
            id="mixed-protocols",
        ),
        pytest.param(
            GOOD.replace("  - name: g\n", "  - name: a\n"),
            "6:11: backends[1].name: duplicate backend name 'a'",
            id="duplicate-backend",
        ),
        pytest.param(
            GOOD.replace("    backend: a\n", "    backend: a\n    backend: a\n"),
            "14:5: routes[0].backend: duplicate key 'backend' (first at line 13)",
            id="duplicate-key",
        ),
        pytest.param(
            "filters: [request_id, access_log]\n",
            "1:10: filters: the filter chain must contain 'route'",
            id="filters-without-route",
        ),
        pytest.param(
            "filters: [route, route]\n",
            "1:10: filters: each filter may appear once; repeated: route",
            id="filters-duplicate",
        ),
        pytest.param(
            "timeouts:\n  connect_s: [1, 2\n",
            "3:1: yaml: expected ',' or ']', but got '<stream end>'",
            id="yaml-syntax",
        ),
        pytest.param("a: 1\n---\nb: 2\n", "2:1: yaml: expected a single document", id="two-docs"),
        pytest.param("- 1\n- 2\n", "1:1: the top level must be a mapping", id="not-a-mapping"),
        pytest.param("# nothing\n", "1:1: the policy document is empty", id="empty"),
        pytest.param(
            "timeouts:\n  connect_s: .inf\n",
            "2:14: timeouts.connect_s: Input should be a finite number",
            id="infinite",
        ),
        pytest.param(
            "x: !!python/object/apply:os.system [true]\n",
            "1:4: x: unsupported tag 'tag:yaml.org,2002:python/object/apply:os.system'",
            id="python-tag",
        ),
        pytest.param(
            "datapath:\n  enabled: true\n  max_header_block_bytes: 20000\n",
            "3:27: datapath.max_header_block_bytes: 20000 would drop clients whose metadata "
            "fits limits.grpc_max_metadata_bytes (16384): use at least 32768",
            id="header-block-below-metadata-cap",
        ),
        pytest.param(
            "mock_backend:\n  admin: 0.0.0.0:18002\n",
            "2:10: mock_backend.admin: the simulated backend's admin API listens on loopback only",
            id="mock-admin-not-loopback",
        ),
        pytest.param(
            "base: &b {connect_s: 1}\ntimeouts:\n  <<: *b\n",
            "3:3: timeouts: merge keys (<<) are not supported",
            id="merge-key",
        ),
    ],
)
def test_error_points_at_the_node(tmp_path: Path, text: str, expected: str) -> None:
    errors = errors_of(tmp_path, text)
    assert any(e.startswith(expected) for e in errors), errors


def test_all_errors_are_reported_in_file_order(tmp_path: Path) -> None:
    text = "timeouts:\n  connect_s: fast\n  bogus: 1\nlisteners:\n  http: {host: x}\n"
    errors = errors_of(tmp_path, text)
    assert [e.split(": ")[0] for e in errors] == ["2:14", "3:3", "5:9"]


def test_too_large_file_is_refused_before_parsing(tmp_path: Path) -> None:
    errors = errors_of(tmp_path, "a: " + "x" * MAX_BYTES + "\n")
    assert errors == [f"1:1: file is larger than {MAX_BYTES} bytes (1 MiB cap)"]


def test_alias_bomb_is_refused(tmp_path: Path) -> None:
    # "Billion laughs": 10^7 values from a few hundred bytes.
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 8):
        refs = ", ".join([f"*l{i - 1}"] * 10)
        levels.append(f"l{i}: &l{i} [{refs}]")
    errors = errors_of(tmp_path, "\n".join(levels) + "\n")
    assert len(errors) == 1
    assert errors[0].endswith(f"document expands to more than {MAX_NODES} values (alias bomb?)")


def test_small_aliases_are_fine() -> None:
    text = (
        GOOD + "  - name: r2\n    match: &m {protocol: http, path_prefix: /v2/}\n    backend: a\n"
    )
    text += "  - name: r3\n    match: *m\n    backend: a\n"
    policy = load_policy_text(text, "mem")
    assert policy.routes[2].match.path_prefix == "/v2/"


def test_recursive_alias_is_refused() -> None:
    with pytest.raises(PolicyError, match=r"mem:1:4: nested deeper than"):
        load_policy_text("a: &a [*a]\n", "mem")


def test_deep_nesting_is_refused() -> None:
    with pytest.raises(PolicyError, match="nested"):
        load_policy_text("[" * 5000, "mem")


def test_invalid_utf8_has_a_position(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"version: 1\nx: \xff\n")
    with pytest.raises(PolicyError, match=r"p.yaml:2:4: not valid UTF-8"):
        load_policy(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "absent.yaml")


def test_yaml_11_booleans_as_keys_stay_strings() -> None:
    # `on:` or `no:` would be booleans for PyYAML; as keys they are names, reported as such.
    with pytest.raises(PolicyError, match=r"mem:1:1: on: unknown field"):
        load_policy_text("on: 1\n", "mem")


def test_references_checked_when_built_in_python() -> None:
    # Outside the loader (no positions), the model still refuses a dangling reference.
    with pytest.raises(ValueError, match=r"routes\[0\]\.backend: unknown backend 'x'"):
        Policy.model_validate({"routes": [{"name": "r", "backend": "x"}]})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            GOOD + "    timeout: {first_byte_s: 5}\n",
            "14:5: routes[0].timeout: unknown field; did you mean 'timeouts'?",
            id="route-timeout",
        ),
        pytest.param(
            "timeouts:\n  first_byte: 5\n",
            "2:3: timeouts.first_byte: unknown field; did you mean 'first_byte_s'?",
            id="missing-suffix",
        ),
        pytest.param(
            "Backends: []\n",
            "1:1: Backends: unknown field; did you mean 'backends'?",
            id="case",
        ),
        pytest.param(
            "listeners:\n  http: {port: 1, hots: x}\n",
            "2:19: listeners.http.hots: unknown field; did you mean 'host'?",
            id="nested-optional",
        ),
        pytest.param(
            "rollout: {stages: [5, 100], hold: 3}\n",
            "1:29: rollout.hold: unknown field; did you mean 'hold_s'?",
            id="rollout",
        ),
        pytest.param(
            "limits: {zzz: 1}\n",
            "1:10: limits.zzz: unknown field (known: max_header_bytes, max_header_count,",
            id="no-close-match",
        ),
    ],
)
def test_unknown_field_suggests_the_nearest(tmp_path: Path, text: str, expected: str) -> None:
    errors = errors_of(tmp_path, text)
    assert any(e.startswith(expected) for e in errors), errors


def test_schema_and_cross_field_errors_come_together(tmp_path: Path) -> None:
    text = """\
backends:
  - name: a
    endpoints: [{address: "127.0.0.1:9000"}]
  - name: a
    endpoints: [{address: "127.0.0.1:9001", weight: -1}]
  - name: b
    endpoints: [{address: "127.0.0.1:9002"}]
routes:
  - name: r
    backend: ghost
    timeout: {first_byte_s: 1}
  - name: r
    backend: b
timeouts:
  first_byte_s: -1
"""
    assert errors_of(tmp_path, text) == [
        "4:11: backends[1].name: duplicate backend name 'a'",
        "5:53: backends[1].endpoints[0].weight: Input should be greater than or equal to 0, got -1",
        "10:14: routes[0].backend: unknown backend 'ghost' (known: a, b)",
        "11:5: routes[0].timeout: unknown field; did you mean 'timeouts'?",
        "12:11: routes[1].name: duplicate route name 'r'",
        "15:17: timeouts.first_byte_s: Input should be greater than 0, got -1",
    ]


def test_a_reference_to_a_broken_item_is_not_reported_twice(tmp_path: Path) -> None:
    text = GOOD.replace("127.0.0.1:9000", "not an address")
    errors = errors_of(tmp_path, text)
    assert len(errors) == 1 and "backends[0].endpoints[0].address" in errors[0], errors


def test_checksum_must_match(tmp_path: Path) -> None:
    from gateway.policy.loader import policy_checksum

    good = f"checksum: {policy_checksum(GOOD)}\n{GOOD}"
    load_policy_text(good, "mem")
    # A half-written file (the second route never arrived) is refused, whatever it parses to.
    half = good[: good.index("routes:")] + "routes: []\n"
    errors = errors_of(tmp_path, half)
    assert errors[0].startswith("1:1: checksum: checksum mismatch: the file hashes to sha256:")
    with pytest.raises(PolicyError, match="String should match pattern"):
        load_policy_text("checksum: md5:abc\n", "mem")


def test_end_marker_must_end_the_file(tmp_path: Path) -> None:
    text = "end_marker: '# end of policy'\n" + GOOD + "# end of policy\n\n"
    load_policy_text(text, "mem")
    errors = errors_of(tmp_path, text[: text.index("  - name: g")])
    assert errors == [
        "1:1: end_marker: the file does not end with its end marker '# end of policy' "
        "(cut short while being written?)"
    ]
