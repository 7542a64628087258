"""The TC classifier on a real veth, in network namespaces (tests/datapath/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.datapath.conftest import PORT, Net, _flows_from, _sh
from tests.support import ROOT, require

pytestmark = [pytest.mark.ebpf, pytest.mark.integration]


def _sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, cwd=ROOT,
        timeout=60,
    )  # fmt: skip


def test_attach_status_detach_and_idempotent_reattach(net: Net) -> None:
    from gateway.datapath.loader import bpffs_mounted

    # status reads counters from another process through the pinned maps
    require(bpffs_mounted(), "bpffs not mounted on /sys/fs/bpf (deploy/host-setup.sh mounts it)")
    ns = ["--iface", net.srv_if, "--netns", net.srv_ns]
    r = _sluice("ebpf", "attach", *ns)
    assert r.returncode == 0, r.stderr
    assert net.peer("grpc", "--target", net.target, "-n", "3")["ok"] == 3
    st = json.loads(_sluice("ebpf", "status", "--json", *ns).stdout)
    assert st["attached"] == {"ingress": "sluice_ingress", "egress": "sluice_egress"}
    before = st["stats"]["packets"]
    assert before > 0

    # A restarted gateway re-attaches: same single filter, counters kept (pinned maps).
    assert _sluice("ebpf", "attach", *ns).returncode == 0
    shown = subprocess.run(["tc", "-n", net.srv_ns, "filter", "show", "dev", net.srv_if,
                            "ingress"], capture_output=True, text=True).stdout  # fmt: skip
    assert shown.count("handle 0x1") == 1, shown
    st = json.loads(_sluice("ebpf", "status", "--json", *ns).stdout)
    assert st["stats"]["packets"] >= before

    assert _sluice("ebpf", "detach", *ns).returncode == 0
    st = json.loads(_sluice("ebpf", "status", "--json", *ns).stdout)
    assert st["attached"] == {"ingress": None, "egress": None}
    assert "stats" not in st
    # traffic still flows without the classifier
    assert net.peer("grpc", "--target", net.target, "-n", "2")["ok"] == 2


def test_counters_match_grpc_calls(net: Net, prog: Any) -> None:
    from gateway.datapath.maps import Maps

    n = 25
    assert net.peer("grpc", "--target", net.target, "-n", str(n))["ok"] == n
    flows = _flows_from(Maps(prog), net.good)
    assert len(flows) == 1, flows
    f = flows[0]
    assert f.headers == n  # one HEADERS per unary call from the client
    assert f.data >= n  # the request message (grpc may add an empty END_STREAM DATA)
    assert f.settings >= 1 and f.packets >= n and f.bytes > n * 64
    assert Maps(prog).stats()["h2_lost"] == 0

    # 200 kB messages: DATA frames span many segments; frame lengths carry the parser across
    big = net.peer("grpc", "--target", net.target, "-n", "5", "--size", "200000")
    assert big["ok"] == 5
    flows = _flows_from(Maps(prog), net.good)
    f = max(flows, key=lambda x: x.bytes)
    lost = Maps(prog).stats()["h2_lost"]
    # exact unless sync was lost (then conservative: never more than sent)
    assert f.headers == 5 if lost == 0 else f.headers <= 5, (f, lost)
    assert f.data >= 5 if lost == 0 else True, (f, lost)  # grpc raises max frame size
    assert f.bytes > 5 * 200000 and f.packets < 5 * 200000 // 1500  # GSO: ~64 kB skbs


def test_source_over_budget_dropped_other_passes(net: Net, prog: Any) -> None:
    from gateway.datapath.maps import Maps

    m = Maps(prog)
    m.set_budget((1, 3), (5, 10), source=net.other)  # the default stays unlimited

    streams = net.peer("streams", "--target", net.target, "--source", net.other, "-n", "40",
                       "--timeout", "1.5")  # fmt: skip
    assert streams["responses"] < 40
    syn = net.peer("connect", "--target", net.target, "--source", net.other, "-n", "10",
                   "--timeout", "0.6")  # fmt: skip
    assert syn["ok"] <= 3  # burst 3, one of which the stream client used

    assert net.peer("connect", "--target", net.target, "--source", net.good, "-n", "10",
                    "--timeout", "0.6")["ok"] == 10  # fmt: skip
    assert net.peer("grpc", "--target", net.target, "-n", "30")["ok"] == 30

    by_src = {s.addr: s for s in m.sources()}
    assert by_src[net.other].syn_drops > 0 and by_src[net.other].stream_drops > 0
    assert by_src[net.good].syn_drops == 0 and by_src[net.good].stream_drops == 0
    st = m.stats()
    assert st["syn_drop"] > 0 and st["stream_drop"] > 0


def test_deny_entry_drops_source_then_expires(net: Net, prog: Any) -> None:
    from gateway.datapath.maps import Maps

    m = Maps(prog)
    expiry = m.deny(net.other, ttl_s=3.0)  # CLOCK_MONOTONIC ns, bpf_ktime_get_ns's clock
    assert net.other in m.denied()
    conn = ["connect", "--target", net.target, "-n", "3", "--timeout", "0.5"]
    assert net.peer(*conn, "--source", net.other)["ok"] == 0
    assert net.peer(*conn, "--source", net.good)["ok"] == 3
    time.sleep(max(0.0, (expiry - time.clock_gettime_ns(time.CLOCK_MONOTONIC)) / 1e9) + 0.1)
    assert net.peer(*conn, "--source", net.other)["ok"] == 3
    assert net.other not in m.denied()
    st = m.stats()
    assert st["deny_drop"] > 0 and st["deny_expired"] >= 1


def test_rapid_reset_flow_dropped_other_source_unaffected(net: Net, prog: Any) -> None:
    from gateway.datapath.maps import Maps

    m = Maps(prog)
    m.set_config(rr_window_s=2.0, rr_ratio=0.5, rr_min_headers=50)
    r = net.peer("rapid", "--target", net.target, "--source", net.other, "-n", "300")
    assert not r["pong"], r  # the flow was cut: the PING after the burst is never answered
    blocked = [f for f in _flows_from(m, net.other) if f.blocked]
    assert len(blocked) == 1
    assert blocked[0].headers >= 50 and blocked[0].rst_stream >= 25
    assert net.peer("grpc", "--target", net.target, "-n", "20")["ok"] == 20
    assert not any(f.blocked for f in _flows_from(m, net.good))
    st = m.stats()
    assert st["rapid_reset_flows"] == 1 and st["rapid_reset_drop"] > 0


def test_missing_interface_is_one_clear_error(net: Net) -> None:
    r = _sluice("ebpf", "attach", "--iface", "nope0", "--netns", net.srv_ns)
    assert r.returncode == 1
    assert "no such interface: nope0" in r.stderr
    assert "Traceback" not in r.stderr


def test_egress_priority_class_steers_a_host_qdisc_lane(net: Net, prog: Any) -> None:
    """skb->priority = major:minor of an htb class puts the packet in that class (htb reads
    skb->priority first), so the policy's class -> priority mapping shapes lanes."""
    from gateway.datapath.maps import Maps

    tc = ["tc", "-n", net.srv_ns]
    _sh(*tc, "qdisc", "replace", "dev", net.srv_if, "root", "handle", "1:", "htb", "default", "2")
    try:
        for minor in ("1", "2"):
            _sh(*tc, "class", "add", "dev", net.srv_if, "parent", "1:", "classid", f"1:{minor}",
                "htb", "rate", "1gbit")  # fmt: skip
        Maps(prog).set_classes({"critical": 0x10001, "normal": 0}, {PORT: "critical"})
        assert net.peer("grpc", "--target", net.target, "-n", "10")["ok"] == 10
        shown = subprocess.run([*tc, "-s", "class", "show", "dev", net.srv_if],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        # iproute2 6.1 has no JSON for htb classes: "class htb 1:1 ...\n Sent B bytes P pkt"
        sent = {h: int(p) for h, p in re.findall(r"class htb (\S+) .*\n Sent \d+ bytes (\d+) pkt",
                                                 shown)}  # fmt: skip
        assert sent["1:1"] >= 10  # the server's replies, classified by the egress program
        assert Maps(prog).stats()["egress_classified"] >= sent["1:1"]
    finally:
        subprocess.run([*tc, "qdisc", "del", "dev", net.srv_if, "root"], capture_output=True)


async def test_gateway_sync_loop_writes_policy_and_reads_metrics(net: Net) -> None:
    from gateway.datapath import Datapath
    from gateway.datapath.loader import attachment
    from gateway.policy.model import Datapath as Policy
    from gateway.telemetry import metrics

    policy = Policy(enabled=True, interface=net.srv_if, h2c_ports=[PORT], sync_interval_s=0.1,
                    deny_ttl_s=5)  # fmt: skip
    dp = Datapath(policy, netns=net.srv_ns)
    await dp.start()
    try:
        assert dp.status()["state"] == "attached"
        assert metrics.REGISTRY.get_sample_value("sluice_datapath_up") == 1
        assert net.peer("grpc", "--target", net.target, "-n", "5")["ok"] == 5
        assert dp.deny(net.other)
        await asyncio.sleep(0.3)
        st = dp.status()
        assert st["stats"]["packets"] > 0 and st["denied_sources"] == 1
        sample = metrics.REGISTRY.get_sample_value
        assert (sample("sluice_datapath_events_total", {"event": "packets"}) or 0) > 0
        assert sample("sluice_datapath_denied_sources") == 1
    finally:
        await dp.stop(detach=True)
    # pyroute2's sync API must not run on the event loop's thread
    attached = await asyncio.to_thread(attachment, net.srv_if, net.srv_ns)
    assert attached == {"ingress": None, "egress": None}
    assert metrics.REGISTRY.get_sample_value("sluice_datapath_up") == 0


async def test_optional_datapath_failure_keeps_serving_required_fails() -> None:
    from gateway.datapath import Datapath
    from gateway.errors import DatapathError
    from gateway.policy.model import Datapath as Policy

    dp = Datapath(Policy(enabled=True, interface="nope-if0"))
    await dp.start()  # optional: no exception
    st = dp.status()
    assert st["state"] == "unavailable" and st["error"]
    assert not dp.deny("10.0.0.1")
    with pytest.raises(DatapathError):
        await Datapath(Policy(enabled=True, required=True, interface="nope-if0")).start()


def test_counters_over_ipv6(net: Net, prog: Any) -> None:
    from gateway.datapath.maps import Maps

    assert net.peer("grpc", "--target", f"[{net.srv_ip6}]:{PORT}", "-n", "7")["ok"] == 7
    flows = _flows_from(Maps(prog), net.good6)
    assert len(flows) == 1 and flows[0].headers == 7 and flows[0].data >= 7, flows
