"""`backends[].tls`: the issue's example as written, files read at load with every problem at
its field's line and column, the contexts built once and shared, and the warning of
`insecure_skip_verify`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.errors import PolicyError
from gateway.policy.compiled import compile_policy
from gateway.policy.loader import checked_policy_text, load_policy_text
from gateway.policy.model import Policy
from gateway.policyctl.commands import check
from gateway.tls.upstream import client_tls
from tests.tls_support import Pki, make_pki

EXAMPLE = """\
backends:
  - name: vllm
    protocol: http
    endpoints: [{address: "vllm.internal:8443"}]
    tls: {ca: /etc/sluice/upstream-ca.pem, server_name: vllm.internal, cert: /etc/sluice/client.crt, key: /etc/sluice/client.key}
routes:
  - {name: chat, backend: vllm}
"""  # noqa: E501 - the issue's line, as written


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def with_files(pki: Pki) -> str:
    return (
        EXAMPLE.replace("/etc/sluice/upstream-ca.pem", str(pki.ca.path))
        .replace("/etc/sluice/client.crt", str(pki.client.cert))
        .replace("/etc/sluice/client.key", str(pki.client.key))
    )


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as e:
        load_policy_text(text, "p.yaml")
    return e.value.errors


def test_the_issue_example_is_valid_as_written(pki: Pki) -> None:
    policy = Policy.model_validate(yaml.safe_load(EXAMPLE))  # the schema takes it as written
    tls = policy.backends[0].tls
    assert tls is not None and tls.server_name == "vllm.internal"
    assert not tls.insecure_skip_verify  # verification is on unless written
    # Its files do not exist here: each is an error at its own field.
    assert errors(EXAMPLE) == [
        "p.yaml:5:15: backends[0].tls.ca: cannot read /etc/sluice/upstream-ca.pem: "
        "No such file or directory"
    ]
    loaded = load_policy_text(with_files(pki), "p.yaml")
    b = loaded.backends[0]
    assert b.tls is not None
    built = client_tls(b.tls)
    assert built.server_name == "vllm.internal" and built.verify
    # Compiled endpoints share the contexts the loader built (no file is read again).
    (endpoint,) = compile_policy(loaded).routes[0].endpoints
    assert endpoint.tls is built
    assert endpoint.upstream_key.startswith("vllm.internal:8443#")


@pytest.mark.parametrize(
    ("tls", "field", "message"),
    [
        ("{ca: /nonexistent/ca.pem}", "ca", "cannot read /nonexistent/ca.pem"),
        ("{ca: GARBAGE}", "ca", "GARBAGE holds no PEM certificate"),
        ("{cert: CLIENT_CERT}", "", "set both `cert` and `key` (mutual TLS), or neither"),
        (
            "{cert: CLIENT_CERT, key: SERVER_KEY}",
            "key",
            "SERVER_KEY does not match the certificate in CLIENT_CERT",
        ),
        ("{cert: CLIENT_CERT, key: ENCRYPTED}", "key", "the key is encrypted"),
        ("{cert: CLIENT_CERT, key: GARBAGE}", "key", "GARBAGE holds no PEM private key"),
        ("{server_name: 'a b'}", "server_name", "String should match pattern"),
    ],
)
def test_bad_settings_are_errors_at_their_field(
    pki: Pki, tls: str, field: str, message: str
) -> None:
    garbage = pki.directory / "garbage.pem"
    garbage.write_text("not a certificate\n")
    encrypted = pki.directory / "encrypted.key"
    if not encrypted.exists():
        subprocess.run(
            ["openssl", "ec", "-in", str(pki.client.key), "-aes256", "-passout", "pass:x",
             "-out", str(encrypted)],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
    files = {
        "GARBAGE": str(garbage),
        "CLIENT_CERT": str(pki.client.cert),
        "SERVER_KEY": str(pki.server.key),
        "ENCRYPTED": str(encrypted),
    }
    for name, path in files.items():
        tls, message = tls.replace(name, path), message.replace(name, path)
    line5 = f"    tls: {tls}"
    text = EXAMPLE.replace(EXAMPLE.splitlines()[4], line5)
    # The column of the field's value (of the mapping for a rule across fields).
    col = line5.index(f"{field}: ") + len(field) + 3 if field else line5.index("{") + 1
    where = "backends[0].tls" + (f".{field}" if field else "")
    (line,) = errors(text)
    assert line.startswith(f"p.yaml:5:{col}: {where}: {message}"), line


def test_grpc_backends_cannot_skip_verification() -> None:
    text = EXAMPLE.replace("protocol: http", "protocol: grpc").replace(
        EXAMPLE.splitlines()[4].split("tls: ")[1], "{insecure_skip_verify: true}"
    )
    text = text.replace("{name: chat, backend: vllm}", "{name: c, backend: vllm}")
    (line,) = errors(text)
    assert line.startswith("p.yaml:5:33: backends[0].tls.insecure_skip_verify: grpc backends")


def test_insecure_skip_verify_loads_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = EXAMPLE.replace(
        EXAMPLE.splitlines()[4].split("tls: ")[1], "{insecure_skip_verify: true}"
    )
    policy, warnings = checked_policy_text(text, "p.yaml")
    b = policy.backends[0]
    assert b.tls is not None and not client_tls(b.tls).verify
    assert warnings == [
        "p.yaml:5:33: warning: backends[0].tls.insecure_skip_verify: backend 'vllm' does not "
        "verify its members' certificates: anyone on the path can read and change its traffic"
    ]
    path = tmp_path / "insecure.yaml"
    path.write_text(text)
    assert check([path]) == 0  # a warning, not an error
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{path}: ok (version ")
    assert out[1].startswith(f"{path}:5:33: warning: backends[0].tls.insecure_skip_verify")
    # Without the switch there is no warning.
    assert checked_policy_text(text.replace("true", "false"), "p.yaml")[1] == []
