"""PolicyHolder: a failed reload (bad file or failing build) keeps the old policy serving."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.errors import PolicyError
from gateway.policy.compiled import CompiledPolicy
from gateway.reload.holder import PolicyHolder
from gateway.telemetry import metrics

V1 = """\
backends:
  - name: a
    endpoints: [{address: "127.0.0.1:9000"}]
routes:
  - name: main
    backend: a
"""
V2 = V1.replace("9000", "9010")
BAD = V1.replace("    backend: a\n", "    backend: ghost\n")


def build(c: CompiledPolicy) -> CompiledPolicy:
    return c


def holder_at(tmp_path: Path, text: str = V1) -> tuple[PolicyHolder[CompiledPolicy], Path]:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return PolicyHolder(path, build), path


def reloads(result: str) -> float:
    value = metrics.REGISTRY.get_sample_value("sluice_policy_reloads_total", {"result": result})
    return value or 0.0


def test_boot_with_a_bad_file_is_fatal(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(BAD)
    with pytest.raises(PolicyError, match=r"policy.yaml:6:14: routes\[0\].backend"):
        PolicyHolder(path, build)


def test_reload_good_changes_version(tmp_path: Path) -> None:
    holder, path = holder_at(tmp_path)
    v1 = holder.version
    before = reloads("ok")
    path.write_text(V2)
    result = holder.reload()
    assert result.ok and result.changed
    assert holder.version == result.version != v1
    assert holder.active.version == holder.version
    assert holder.compiled is holder.active
    assert reloads("ok") == before + 1
    assert metrics.REGISTRY.get_sample_value("sluice_policy_info", {"version": holder.version}) == 1


def test_reload_unchanged(tmp_path: Path) -> None:
    holder, path = holder_at(tmp_path)
    active = holder.active
    path.write_text(V1 + "# a comment changes nothing\n")
    result = holder.reload()
    assert result.ok and not result.changed
    assert holder.active is active


def test_reload_bad_keeps_old_and_reports_the_line(tmp_path: Path) -> None:
    holder, path = holder_at(tmp_path)
    v1, active = holder.version, holder.active
    before = reloads("error")
    path.write_text(BAD)
    result = holder.reload()
    assert not result.ok and not result.changed
    assert result.version == v1 == holder.version
    assert holder.active is active
    assert result.errors == (f"{path}:6:14: routes[0].backend: unknown backend 'ghost' (known: a)",)
    assert reloads("error") == before + 1
    assert metrics.REGISTRY.get_sample_value("sluice_policy_last_reload_success") == 0
    status = holder.status()
    assert status["version"] == v1
    assert status["reloads"] == 1
    assert status["last_reload"]["ok"] is False  # type: ignore[index]
    assert status["last_error"]["errors"] == list(result.errors)  # type: ignore[index]
    # Fixing the file recovers; the last error stays visible for the post-mortem.
    path.write_text(V2)
    assert holder.reload().changed
    assert holder.status()["last_error"]["errors"] == list(result.errors)  # type: ignore[index]
    assert metrics.REGISTRY.get_sample_value("sluice_policy_last_reload_success") == 1


def test_build_failure_keeps_old(tmp_path: Path) -> None:
    calls: list[str] = []

    def flaky(c: CompiledPolicy) -> CompiledPolicy:
        calls.append(c.version)
        if len(calls) > 1:
            raise RuntimeError("chain factory exploded")
        return c

    path = tmp_path / "policy.yaml"
    path.write_text(V1)
    holder = PolicyHolder(path, flaky)
    v1, active = holder.version, holder.active
    path.write_text(V2)
    result = holder.reload()
    assert not result.ok
    assert holder.version == v1 and holder.active is active
    assert result.errors == (
        f"{path}:1:1: cannot build policy: RuntimeError: chain factory exploded",
    )


def test_vanished_file_keeps_old(tmp_path: Path) -> None:
    holder, path = holder_at(tmp_path)
    v1 = holder.version
    path.unlink()
    result = holder.reload()
    assert not result.ok and holder.version == v1
    assert "cannot read" in result.errors[0]


def test_each_load_logs_the_policys_warnings_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    insecure = V1.replace("    endpoints:", "    tls: {insecure_skip_verify: true}\n    endpoints:")
    caplog.set_level(logging.WARNING, logger="sluice.policy")
    holder, path = holder_at(tmp_path, insecure)

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "insecure_skip_verify" in r.getMessage()]

    (line,) = warned()
    assert line.startswith(f"{path}:3:33: warning: backends[0].tls.insecure_skip_verify: ")
    assert "backend 'a' does not verify" in line
    path.write_text(insecure.replace("9000", "9010"))
    assert holder.reload().ok
    assert warned() == [line, line]  # once per load, not once per member or per connection
    path.write_text(V1)
    assert holder.reload().ok
    assert len(warned()) == 2  # verification back on: nothing more
