"""The container image: built by deploy/build-image.sh, run with podman (runc) as a user would.

Runs with a read-only root filesystem and a mounted policy (free ports, the built-in simulated
backend), sends the README's chat completion, checks the process is not root, then sends
SIGTERM while a stream is in flight: the stream finishes and the container exits 0.
Strict in CI: without podman (deploy/host-setup.sh installs it) the test fails there.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ROOT, free_port, require_binary, require_root

pytestmark = pytest.mark.integration

TAG = "localhost/sluice:test"
PODMAN = ["podman", "--runtime", "runc"]
# crun fails on this kernel's cgroups and podman's default nproc limit is refused: runc with
# explicit limits is what works here (and in CI, on the same kind of machine).
RUN = ["--network", "host", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]

POLICY = """\
version: 1
listeners:
  http: {{host: 127.0.0.1, port: {http}}}
  grpc: {{host: 127.0.0.1, port: {grpc}}}
  admin: {{host: 127.0.0.1, port: {admin}}}
timeouts: {{drain_s: 20}}
mock_backend:
  enabled: true
  http: 127.0.0.1:{mock_http}
  grpc: 127.0.0.1:{mock_grpc}
  admin: 127.0.0.1:{mock_admin}
  token_delay_ms: 50
  completion_tokens: 30
backends:
  - name: sim-http
    protocol: http
    endpoints: [{{address: "127.0.0.1:{mock_http}"}}]
  - name: sim-grpc
    protocol: grpc
    endpoints: [{{address: "127.0.0.1:{mock_grpc}"}}]
routes:
  - name: grpc-all
    match: {{protocol: grpc}}
    backend: sim-grpc
  - name: http-all
    match: {{protocol: http, path_prefix: /}}
    backend: sim-http
"""

CHAT = {"model": "any", "messages": [{"role": "user", "content": "Hello"}]}  # README "Try it"


def podman(*args: str, timeout: float = 60, check: bool = True) -> str:
    out = subprocess.run(
        [*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and out.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {out.returncode}\n{out.stderr}")
    return out.stdout.strip()


@pytest.fixture(scope="module")
def image() -> str:
    require_root()
    for name in ("podman", "runc", "debootstrap"):
        require_binary(name)
    t0 = time.monotonic()
    build = subprocess.run(
        ["bash", str(ROOT / "deploy" / "build-image.sh"), TAG],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    print(f"\nimage build {time.monotonic() - t0:.1f} s: {build.stdout.strip().splitlines()[-1]}")
    return TAG


@pytest.fixture
def container(image: str, tmp_path: Path) -> Iterator[tuple[str, dict[str, int]]]:
    keys = ("http", "grpc", "admin", "mock_http", "mock_grpc", "mock_admin")
    ports = {k: free_port() for k in keys}
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(**ports))
    policy.chmod(0o644)
    name = f"sluice-test-{os.getpid()}"
    podman("rm", "-f", name, check=False)
    t0 = time.monotonic()
    podman(
        "run", "-d", "--name", name, *RUN, "--read-only",
        "-v", f"{policy}:/etc/sluice/policy.yaml:ro",
        "-e", "SLUICE_POLICY=/etc/sluice/policy.yaml",
        image,
    )  # fmt: skip
    try:
        _wait_ready(ports["admin"], name)
        print(f"podman run to ready: {time.monotonic() - t0:.2f} s")
        yield name, ports
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)


def logs(name: str) -> str:
    """The container's output (podman replays its stderr on stderr)."""
    out = subprocess.run([*PODMAN, "logs", name], capture_output=True, text=True, timeout=30)
    return out.stdout + out.stderr


def _wait_ready(admin: int, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            e.close()
        except OSError:
            pass
        if podman("inspect", name, "--format", "{{.State.Running}}", check=False) == "false":
            raise AssertionError(f"container exited:\n{logs(name)}")
        time.sleep(0.1)
    raise AssertionError(f"not ready after {timeout} s:\n{logs(name)}")


def _wait_in_flight(admin: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/admin/state", timeout=5) as r:
            if json.loads(r.read())["gateway"]["in_flight"] >= 1:
                return
        time.sleep(0.05)
    raise AssertionError("the stream never showed as in flight")


def _post(port: int, body: dict, timeout: float = 30) -> bytes:  # type: ignore[type-arg]
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        return bytes(r.read())


@pytest.mark.timeout(900)  # the image build (its module fixture) compiles the request path
def test_image_serves_as_non_root_and_drains_on_sigterm(
    container: tuple[str, dict[str, int]],
) -> None:
    name, ports = container
    answer = json.loads(_post(ports["http"], CHAT))
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    assert podman("exec", name, "id", "-u") == "10001"
    assert podman("inspect", name, "--format", "{{.Config.User}}") == "10001:10001"
    # Nothing can be written outside /tmp.
    denied = subprocess.run(
        [*PODMAN, "exec", name, "touch", "/opt/sluice/x"], capture_output=True, timeout=30
    )
    assert denied.returncode != 0

    # A 30-token stream at 50 ms per token (~1.5 s) is in flight when SIGTERM arrives.
    stream: dict[str, bytes] = {}
    body = {**CHAT, "stream": True}
    t = threading.Thread(target=lambda: stream.update(out=_post(ports["http"], body)))
    t.start()
    _wait_in_flight(ports["admin"])
    podman("kill", "--signal", "TERM", name)
    t.join(30)
    code = podman("wait", name, timeout=60)
    output = logs(name)
    assert code == "0", output
    assert stream["out"].rstrip().endswith(b"data: [DONE]"), stream
    assert stream["out"].count(b"data: ") > 30  # every token, then [DONE]
    assert "draining: 1 requests in flight" in output, output
