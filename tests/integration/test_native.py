"""The compiled request path (gateway/native.py): what runs is the build of these sources, or
all of them from source, never a mix or an old build.

- The strict suite runs compiled: every module of `MODULES` is an extension module here.
- A copy of the package whose source changed after the build imports every one of them from
  source and says why; `SLUICE_PURE=1` does the same on request.
- A gateway serving interpreted (`SLUICE_PURE=1`) answers as the compiled one does.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gateway import native
from tests.integration.conftest import Backend, policy_yaml, wait_ready
from tests.support import ROOT, Proc, free_port, require

pytestmark = pytest.mark.integration

PROBE = (
    "import importlib, json; from gateway import native; "
    "print(json.dumps([native.STATE, "
    "{m: importlib.import_module(m).__file__ for m in native.MODULES}]))"
)


def _compiled() -> None:
    require(native.STATE == "compiled", f"the request path is not compiled ({native.STATE})")


def _probe(cwd: Path, **env: str) -> tuple[str, dict[str, str]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(cwd), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    state, files = json.loads(out)
    return state, files


def test_every_module_of_the_request_path_runs_compiled() -> None:
    _compiled()
    for name in native.MODULES:
        file = importlib.import_module(name).__file__ or ""
        assert file.endswith(".so"), (name, file)
    assert native.built_for(native.PACKAGE) == native.digest(native.PACKAGE.parent)


def test_a_source_changed_after_the_build_runs_everything_from_source(tmp_path: Path) -> None:
    _compiled()
    shutil.copytree(
        native.PACKAGE, tmp_path / "gateway", ignore=shutil.ignore_patterns("__pycache__")
    )
    state, files = _probe(tmp_path)
    assert state == "compiled"
    assert all(f.endswith(".so") for f in files.values())
    headers = tmp_path / "gateway" / "forward" / "headers.py"
    headers.write_text(headers.read_text() + "\n# edited after the build\n")
    state, files = _probe(tmp_path)
    assert state.startswith("pure: the compiled build is older than its sources")
    assert set(files) == set(native.MODULES)
    for name, file in files.items():  # all of them, not only the edited one
        assert file == str(tmp_path.joinpath(*name.split(".")).with_suffix(".py")), name


def test_sluice_pure_asks_for_the_sources() -> None:
    state, files = _probe(ROOT, SLUICE_PURE="1")
    assert state == "pure: SLUICE_PURE=1"
    assert all(f.endswith(".py") for f in files.values())


def test_an_interpreted_gateway_answers_as_the_compiled_one(
    backend: Backend, tmp_path: Path
) -> None:
    http, grpc, admin = free_port(), free_port(), free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml(backend, http, grpc, admin, engine="native"))
    proc = Proc(
        ["serve", "--policy", str(policy)], tmp_path / "gateway.log", env={"SLUICE_PURE": "1"}
    )
    try:
        wait_ready(admin, proc)
        body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]})
        req = urllib.request.Request(
            f"http://127.0.0.1:{http}/v1/chat/completions",
            data=body.encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            doc = json.loads(resp.read())
            assert resp.status == 200
            assert resp.headers["x-sluice-overhead-ms"]
        assert doc["usage"]["completion_tokens"] > 0
    finally:
        assert proc.stop() == 0
    assert "request path interpreted" not in proc.output()  # asked for: no warning
