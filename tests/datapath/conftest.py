"""Network namespaces, a veth pair and the classifier, shared by the datapath tests.

Topology (names carry a random suffix so parallel runs do not collide):
  netns S: veth `s<id>` 10.<a>.<b>.1/24, the gRPC h2c server; the classifier is attached here
  netns C: veth `c<id>` 10.<a>.<b>.2/24 (the "good" source) and .3/24 (the second source)
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, require, require_binary, require_root

PEER = Path(__file__).resolve().parent / "_peer.py"
PORT = 8081


@dataclass
class Net:
    srv_ns: str
    cli_ns: str
    srv_if: str
    srv_ip: str
    good: str
    other: str

    @property
    def srv_ip6(self) -> str:
        return "fd00:5:" + self.srv_ip.split(".", 1)[1].replace(".", ":") + "::1"

    @property
    def good6(self) -> str:
        return self.srv_ip6[:-1] + "2"

    @property
    def target(self) -> str:
        return f"{self.srv_ip}:{PORT}"

    def peer(self, *args: str, timeout: float = 30) -> dict[str, Any]:
        out = subprocess.run(
            ["ip", "netns", "exec", self.cli_ns, sys.executable, str(PEER), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _prereqs() -> None:
    require_root()
    require_binary("ip")
    from gateway.datapath.loader import import_bcc, preflight
    from gateway.errors import DatapathError

    try:
        import_bcc()
        preflight()
    except DatapathError as exc:
        require(False, str(exc))


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    _prereqs()
    rid = f"{random.randrange(16**6):06x}"
    a, b = random.randrange(100, 250), random.randrange(0, 255)
    n = Net(f"sluice-t-{rid}-s", f"sluice-t-{rid}-c", f"s{rid}", f"10.{a}.{b}.1",
            f"10.{a}.{b}.2", f"10.{a}.{b}.3")  # fmt: skip
    server: subprocess.Popen[str] | None = None
    try:
        _sh("ip", "netns", "add", n.srv_ns)
        _sh("ip", "netns", "add", n.cli_ns)
        _sh("ip", "-n", n.srv_ns, "link", "add", n.srv_if, "type", "veth", "peer", "name",
            f"c{rid}", "netns", n.cli_ns)  # fmt: skip
        _sh("ip", "-n", n.srv_ns, "addr", "add", f"{n.srv_ip}/24", "dev", n.srv_if)
        _sh("ip", "-n", n.cli_ns, "addr", "add", f"{n.good}/24", "dev", f"c{rid}")
        _sh("ip", "-n", n.cli_ns, "addr", "add", f"{n.other}/24", "dev", f"c{rid}")
        # IPv6 (ULA, inside these namespaces only); nodad: usable at once
        _sh("ip", "-n", n.srv_ns, "addr", "add", f"{n.srv_ip6}/64", "dev", n.srv_if, "nodad")
        _sh("ip", "-n", n.cli_ns, "addr", "add", f"{n.good6}/64", "dev", f"c{rid}", "nodad")
        for ns, dev in ((n.srv_ns, n.srv_if), (n.cli_ns, f"c{rid}")):
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        server = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                n.srv_ns,
                sys.executable,
                str(PEER),
                "server",
                "--host",
                "[::]",
                "--port",
                str(PORT),
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert server.stdout is not None
        assert json.loads(server.stdout.readline())["ready"]
        yield n
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
            if server.stdout is not None:
                server.stdout.close()
        from gateway.datapath.loader import detach

        try:
            detach(n.srv_if, n.srv_ns)
        except Exception:  # noqa: BLE001 - the namespace may not exist
            pass
        subprocess.run(["ip", "netns", "del", n.srv_ns], capture_output=True)
        subprocess.run(["ip", "netns", "del", n.cli_ns], capture_output=True)


@pytest.fixture
def prog(net: Net) -> Iterator[Any]:
    """A freshly loaded and attached classifier (fresh maps) with the default policy ports."""
    from gateway.datapath.loader import BpfProgram, detach
    from gateway.datapath.maps import Maps
    from gateway.policy.model import Datapath

    detach(net.srv_if, net.srv_ns)  # fresh pinned maps
    p = BpfProgram(net.srv_if, netns=net.srv_ns)
    p.load()
    Maps(p).apply_policy(Datapath(h2c_ports=[PORT]))
    p.attach()
    try:
        yield p
    finally:
        p.close()
        detach(net.srv_if, net.srv_ns)


def _flows_from(maps: Any, src: str) -> list[Any]:
    return [f for f in maps.flows() if f.src == src and f.dport == PORT]
