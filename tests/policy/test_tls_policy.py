"""`listeners.*.tls` in the policy: the shape, and `sluice policy check` loading the files (an
unreadable, garbage or mismatched file, an expired certificate) with file:line:col of the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.errors import PolicyError
from gateway.policy.loader import load_policy, load_policy_text
from tests.support import ROOT
from tests.tls_support import TestCA

BASE = """version: 1
listeners:
  http:
    host: 127.0.0.1
    port: 8443
    tls:
      cert: {cert}
      key: {key}
      client_ca: {ca}
      client_cert: {mode}
  grpc:
    host: 127.0.0.1
    port: 8444
    tls: {{cert: {cert}, key: {key}}}
"""


def policy(tmp: Path, ca: TestCA, mode: str = "off", **paths: Path) -> Path:
    good = ca.server()
    p = tmp / "policy.yaml"
    p.write_text(
        BASE.format(
            cert=paths.get("cert", good.cert),
            key=paths.get("key", good.key),
            ca=paths.get("client_ca", ca.path),
            mode=mode,
        )
    )
    return p


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "ca")


def test_the_issue_shape_loads_and_off_may_be_bare_yaml(tmp_path: Path, ca: TestCA) -> None:
    p = load_policy(policy(tmp_path, ca), check_files=True)
    http = p.listeners.http
    assert http is not None and http.tls is not None
    assert http.tls.client_cert == "off"  # YAML 1.1 reads `off` as false
    assert p.timeouts.tls_handshake_s == 10.0
    assert (
        load_policy(policy(tmp_path, ca, "required")).listeners.http.tls.client_cert == "required"
    )  # type: ignore[union-attr]


def check(path: Path) -> list[str]:
    with pytest.raises(PolicyError) as e:
        load_policy(path, check_files=True)
    return e.value.errors


def test_unreadable_files_point_at_their_fields(tmp_path: Path, ca: TestCA) -> None:
    p = policy(tmp_path, ca, cert=tmp_path / "missing.crt")
    errors = check(p)
    assert errors == [
        f"{p}:7:13: listeners.http.tls.cert: cannot read {tmp_path}/missing.crt: "
        "No such file or directory",
        f"{p}:14:17: listeners.grpc.tls.cert: cannot read {tmp_path}/missing.crt: "
        "No such file or directory",
    ]
    load_policy(p)  # without check_files (a reload): the files are not looked at


def test_garbage_mismatch_and_expired(tmp_path: Path, ca: TestCA) -> None:
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("hello\n")
    errors = check(policy(tmp_path, ca, cert=garbage))
    assert (
        ":7:13: listeners.http.tls.cert:" in errors[0] and "holds no PEM certificate" in errors[0]
    )
    other = ca.server("other")
    errors = check(policy(tmp_path, ca, key=other.key))
    assert ":8:12: listeners.http.tls.key:" in errors[0]
    assert "is not the key of the certificate" in errors[0]
    old = ca.server("old", expired=True)
    errors = check(policy(tmp_path, ca, cert=old.cert, key=old.key))
    assert ":7:13: listeners.http.tls.cert:" in errors[0] and "expired at" in errors[0]
    errors = check(policy(tmp_path, ca, "required", client_ca=garbage))
    assert ":9:18: listeners.http.tls.client_ca:" in errors[0]


def test_shape_errors(tmp_path: Path, ca: TestCA) -> None:
    good = ca.server()
    text = BASE.format(cert=good.cert, key=good.key, ca=ca.path, mode="optional")
    with pytest.raises(PolicyError) as e:
        load_policy_text(
            text.replace(
                "tls: {cert", "engine: grpcio\n    tls: {client_cert: optional, client_ca: x, cert"
            )
        )
    assert "listeners.grpc.tls.client_cert: grpcio either requires" in e.value.errors[0]
    for engine in ("engine: h2\n    ", ""):  # h2, written or the default
        h2 = text.replace(
            "tls: {cert", f"{engine}tls: {{client_cert: optional, client_ca: {ca.path}, cert"
        )
        assert load_policy_text(h2).listeners.grpc.tls.client_cert == "optional"  # type: ignore[union-attr]
    no_ca = text.replace(f"      client_ca: {ca.path}\n", "")
    with pytest.raises(PolicyError) as e:
        load_policy_text(no_ca)
    assert "client_cert: optional needs client_ca" in e.value.errors[0]
    admin = text + f"  admin: {{port: 9901, tls: {{cert: {good.cert}, key: {good.key}}}}}\n"
    with pytest.raises(PolicyError) as e:
        load_policy_text(admin)
    assert "listeners.admin.tls: the admin listener serves plaintext only" in e.value.errors[0]


def test_policy_check_command(tmp_path: Path, ca: TestCA) -> None:
    p = policy(tmp_path, ca, key=tmp_path / "nope.key")
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "policy", "check", str(p)],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stdout.startswith(f"{p}:8:12: listeners.http.tls.key: cannot read ")


def test_the_docs_steps_make_files_the_tls_example_accepts(tmp_path: Path) -> None:
    """The TLS page's openssl steps (docs/operating/tls.md, run as written, in a temporary
    directory instead of /tmp/sluice-tls) make files that `sluice policy check` accepts for the
    shipped example."""
    page = (ROOT / "docs" / "operating" / "tls.md").read_text()
    section = page[page.index("\n## Try it\n") :]
    steps = section[section.index("```bash\n") + 8 : section.index("```\n")]
    assert steps.startswith("mkdir -p /tmp/sluice-tls")
    out = subprocess.run(
        ["bash", "-euc", steps.replace("/tmp/sluice-tls", str(tmp_path))],
        capture_output=True, text=True, cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    example = (ROOT / "deploy" / "tls" / "edge-tls.yaml").read_text()
    copy = tmp_path / "tls.yaml"
    copy.write_text(example.replace("/tmp/sluice-tls/", f"{tmp_path}/"))
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "policy", "check", str(copy)],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    from tests.tls_support import peer_identity_of

    assert peer_identity_of(tmp_path / "client.crt") == "spiffe://example.org/client-a"
