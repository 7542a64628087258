"""`sluice host plan|apply|rollback` inside a network namespace this test creates and removes:
every per-namespace value and the interface's root qdisc come back exactly; the host's global
settings are never touched (the namespace does not expose them)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ROOT, require_binary, require_root

pytestmark = [pytest.mark.integration]

PER_NETNS = (
    "net.ipv4.tcp_congestion_control",
    "net.ipv4.tcp_notsent_lowat",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
    "net.core.rmem_max",  # read-only inside a netns: plan says so, apply leaves it
    "net.core.wmem_max",
)


@pytest.fixture
def netns() -> Iterator[str]:
    require_root()
    require_binary("ip")
    require_binary("tc")
    ns = f"sluice-t-{random.randrange(16**6):06x}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "h0", "type", "veth", "peer", "name", "h1"],
                       check=True)  # fmt: skip
        subprocess.run(["ip", "-n", ns, "link", "set", "h0", "up"], check=True)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def _host(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", "host", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)  # fmt: skip


def _snapshot(ns: str) -> dict[str, str]:
    out = {}
    for name in PER_NETNS:
        path = "/proc/sys/" + name.replace(".", "/")
        r = subprocess.run(["ip", "netns", "exec", ns, "cat", path], capture_output=True,
                           text=True, check=True)  # fmt: skip
        out[name] = " ".join(r.stdout.split())
    r = subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", "h0", "root"],
                       capture_output=True, text=True, check=True)  # fmt: skip
    out["qdisc"] = json.loads(r.stdout)[0]["kind"]
    return out


def _global() -> dict[str, str]:
    return {n: Path("/proc/sys/net/core/" + n).read_text() for n in ("default_qdisc", "rmem_max")}


def test_plan_apply_rollback_restores_every_value(netns: str, tmp_path: Path) -> None:
    rb = tmp_path / "rollback.json"
    common = ["--netns", netns, "--iface", "h0", "--rollback-file", str(rb)]
    # htb stands in at the end of the chain: this VM kernel may have none of fq_pie/fq/fq_codel
    pref = ["--qdisc-preference", "fq_pie,fq,fq_codel,htb"]
    # Make the namespace differ from the desired state in known ways first.
    subprocess.run(["ip", "netns", "exec", netns, "sysctl", "-q", "-w",
                    "net.ipv4.tcp_notsent_lowat=123456", "net.ipv4.tcp_wmem=4096 8192 65536",
                    "net.ipv4.tcp_congestion_control=reno"], check=True)  # fmt: skip
    before, host_before = _snapshot(netns), _global()

    r = _host("plan", "--json", *common, *pref)
    assert r.returncode == 0, r.stderr
    plan = {i["name"]: i for i in json.loads(r.stdout)}
    assert plan["net.ipv4.tcp_notsent_lowat"]["desired"] == "16384"
    assert plan["net.core.default_qdisc"]["current"] is None  # global: not in a netns
    cc = plan["net.ipv4.tcp_congestion_control"]
    assert cc["desired"] in ("bbr2", "bbr3", "bbr", "cubic") and cc["current"] == "reno"
    assert plan["qdisc:h0"]["desired"] in ("fq_pie", "fq", "fq_codel", "htb")
    assert not rb.exists()  # plan changes nothing

    r = _host("apply", *common, *pref)
    assert r.returncode == 0, r.stderr
    after = _snapshot(netns)
    assert after["net.ipv4.tcp_notsent_lowat"] == "16384"
    assert after["net.ipv4.tcp_congestion_control"] == cc["desired"]
    assert after["qdisc"] == plan["qdisc:h0"]["desired"]
    assert after["net.ipv4.tcp_wmem"] == "4096 8192 16777216"  # max raised, never shrunk
    assert rb.exists()
    assert _host("apply", *common, *pref).returncode == 1  # refuses to overwrite the baseline

    r = _host("rollback", *common)
    assert r.returncode == 0, r.stderr
    assert _snapshot(netns) == before
    assert _global() == host_before
    assert not rb.exists()
    r = _host("rollback", *common)
    assert r.returncode == 1 and "nothing to roll back" in r.stderr
