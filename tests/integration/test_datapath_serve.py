"""`sluice serve` with the eBPF datapath in the policy: optional → serves without it and says so;
required → refuses to start with one clear error line."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import Backend, http_json, policy_yaml, start_gateway
from tests.support import Proc, free_port

pytestmark = pytest.mark.integration

MISSING_IFACE = "sluice-nope0"  # an interface that does not exist: attaching must fail


def datapath_yaml(required: bool) -> str:
    return (
        f"datapath:\n  enabled: true\n  required: {'true' if required else 'false'}\n"
        f"  interface: {MISSING_IFACE}\n"
    )


def test_optional_datapath_that_cannot_attach_leaves_the_gateway_serving(
    backend: Backend, tmp_path: Path
) -> None:
    gw = start_gateway(backend, tmp_path, tail=datapath_yaml(required=False))
    try:
        ready = http_json(f"{gw.admin}/readyz")
        assert ready["ready"] is True
        assert ready["datapath"]["state"] == "unavailable"
        assert ready["datapath"]["error"]
        with urllib.request.urlopen(f"{gw.http}/v1/models", timeout=5) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"{gw.admin}/metrics", timeout=5) as r:
            assert "sluice_datapath_up 0.0" in r.read().decode()
    finally:
        assert gw.proc.stop() == 0


def test_required_datapath_that_cannot_attach_refuses_to_start(
    backend: Backend, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    http, grpc, admin = free_port(), free_port(), free_port()
    policy.write_text(policy_yaml(backend, http, grpc, admin, tail=datapath_yaml(required=True)))
    proc = Proc(["serve", "--policy", str(policy)], tmp_path / "gateway.log")
    try:
        assert proc.popen.wait(30) == 1
    finally:
        proc.stop()
    errors = [line for line in proc.output().splitlines() if '"level":"error"' in line]
    assert len(errors) == 1 and MISSING_IFACE in errors[0], proc.output()
