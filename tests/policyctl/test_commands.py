"""`sluice policy check|schema|diff`, run as real subprocesses where the exit code matters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.policy.loader import load_policy, load_policy_text
from gateway.policyctl.commands import diff_policies, schema_text
from tests.support import ROOT

SHIPPED = sorted(
    [ROOT / "policies" / "default.yaml", *(ROOT / "policies" / "examples").glob("*.yaml")]
)

BASE = """\
backends:
  - name: a
    endpoints: [{address: "127.0.0.1:9000"}]
  - name: old
    endpoints: [{address: "127.0.0.1:9001"}]
routes:
  - name: main
    backend: a
"""


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_examples_exist() -> None:
    names = {p.name for p in SHIPPED}
    assert "default.yaml" in names
    assert len(names) >= 6, names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_policies_are_valid(path: Path) -> None:
    load_policy(path)


def test_check_cli_ok_on_every_shipped_policy() -> None:
    # The TLS example names files the README's steps make, so it lives in deploy/tls
    # (tests/policy/test_tls_policy.py runs the steps and checks it).
    result = sluice("policy", "check", *map(str, SHIPPED))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(SHIPPED)
    assert all(" ok (version " in line for line in lines), lines


def test_check_cli_reports_errors_with_positions(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("timeouts:\n  connect_s: -1\nroutes:\n  - name: r\n    backend: ghost\n")
    result = sluice("policy", "check", str(bad))
    assert result.returncode == 1
    # Schema errors and cross-references in one pass, in file order.
    assert result.stdout.splitlines() == [
        f"{bad}:2:14: timeouts.connect_s: Input should be greater than 0, got -1",
        f"{bad}:5:14: routes[0].backend: unknown backend 'ghost' (known: none defined)",
    ]


def test_check_cli_mixed_files_exit_1(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(BASE)
    bad.write_text("version: 2\n")
    result = sluice("policy", "check", str(good), str(bad))
    assert result.returncode == 1
    out = result.stdout.splitlines()
    assert out[0].startswith(f"{good}: ok (version ")
    assert out[1].startswith(f"{bad}:1:10: version: Input should be 1")


def test_schema_file_is_in_sync() -> None:
    # Regenerate with: .venv/bin/python -m gateway policy schema > policies/schema.json
    shipped = (ROOT / "policies" / "schema.json").read_text()
    assert shipped == schema_text()


def test_schema_cli_prints_the_same() -> None:
    result = sluice("policy", "schema")
    assert result.returncode == 0
    assert result.stdout == schema_text()


def test_diff_lists_changes() -> None:
    old = load_policy_text(BASE, "old")
    new_text = """\
backends:
  - name: a
    endpoints: [{address: "127.0.0.1:9000"}]
  - name: b
    endpoints: [{address: "127.0.0.1:9002"}]
routes:
  - name: main
    backend: a
  - name: canary
    backend: b
timeouts:
  connect_s: 1.0
listeners:
  http: {port: 8088}
"""
    new = load_policy_text(new_text, "new")
    assert diff_policies(old, new) == [
        "~ listeners.http.port: 8080 -> 8088",
        "~ timeouts.connect_s: 2.0 -> 1.0",
        "+ backends[name=b]",
        "- backends[name=old]",
        "+ routes[name=canary]",
        "! listeners.http.port: needs a restart",
    ]


def test_diff_route_edit_and_reorder() -> None:
    text = BASE + "  - name: second\n    backend: old\n"
    old = load_policy_text(text, "old")
    swapped = BASE.replace(
        "routes:\n", "routes:\n  - name: second\n    backend: old\n    strip_prefix: /x\n"
    )
    new = load_policy_text(swapped, "new")
    assert diff_policies(old, new) == [
        "~ routes order: main, second -> second, main",
        '~ routes[name=second].strip_prefix: "" -> "/x"',
    ]
    assert diff_policies(old, old) == []


def test_diff_cli(tmp_path: Path) -> None:
    a, b, bad = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "bad.yaml"
    a.write_text(BASE)
    b.write_text(BASE.replace("  - name: old\n", "  - name: newer\n"))
    bad.write_text("routes: 1\n")
    result = sluice("policy", "diff", str(a), str(b))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("version ")
    assert lines[1:] == ["+ backends[name=newer]", "- backends[name=old]"]
    assert sluice("policy", "diff", str(a), str(a)).stdout.splitlines()[1] == "no changes"
    result = sluice("policy", "diff", str(a), str(bad))
    assert result.returncode == 1
    assert result.stdout.startswith(f"{bad}:1:9: routes: ")


def test_checksum_cli_writes_a_line_the_loader_accepts(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE)
    shown = sluice("policy", "checksum", str(path))
    assert shown.returncode == 0 and shown.stdout.startswith("checksum: sha256:")
    written = sluice("policy", "checksum", str(path), "--write")
    assert written.returncode == 0 and written.stdout == shown.stdout
    text = path.read_text()
    assert text.startswith(shown.stdout) and text.endswith(BASE)
    load_policy(path)
    # Written again after an edit, the line is replaced, not repeated.
    path.write_text(text.replace("9001", "9002"))
    assert sluice("policy", "checksum", str(path), "--write").returncode == 0
    assert path.read_text().count("checksum:") == 1
    load_policy(path)
    # An edit without a new checksum is refused, at the checksum line.
    path.write_text(path.read_text().replace("9002", "9003"))
    result = sluice("policy", "check", str(path))
    assert result.returncode == 1 and f"{path}:1:1: checksum: checksum mismatch" in result.stdout


def test_diff_warns_about_what_refuses_whatever_the_traffic(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(BASE)
    b.write_text(BASE.replace('"127.0.0.1:9000"}', '"127.0.0.1:9000", weight: 0}'))
    result = sluice("policy", "diff", str(a), str(b))
    assert result.returncode == 0
    assert result.stdout.splitlines()[-1] == (
        "warning: route 'main' has no usable endpoint (every weight is 0): its requests get 503"
    )


def test_commands_against_an_absent_gateway_fail_clearly(tmp_path: Path) -> None:
    from tests.support import free_port

    url = f"http://127.0.0.1:{free_port()}"
    path = tmp_path / "p.yaml"
    path.write_text(BASE)
    for args in (
        ("apply", "--admin", url),
        ("rollout", "status", "--admin", url),
        ("check", str(path), "--against", url),
        ("diff", str(path), "--against", url),
    ):
        result = sluice("policy", *args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "cannot reach the admin API" in result.stderr, (args, result.stderr)
    result = sluice("policy", "diff", str(path))
    assert result.returncode == 1 and "diff takes OLD NEW" in result.stderr
