"""HTTP/2 floods against a gRPC server, cut in the kernel by the classifier's h2c frame walker:
a CONTINUATION flood (one header block that never ends) and a PING flood from a client that
never reads. grpc keeps reading both for as long as they last (measured: grpcio 1.85 answers
the stream at its metadata cap but keeps parsing the block, ~1 core and ~100 MB/s of memory per
connection); the walker bounds what reaches it and the flow is dropped. Others keep being served.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.datapath.conftest import Net, _flows_from
from tests.support import ROOT

pytestmark = [pytest.mark.ebpf, pytest.mark.integration]

MAX_HEADER_BLOCK = 65536  # the policy default (datapath.max_header_block_bytes)
ONE_PACKET = 65536 + 1500  # the packet that crosses the bound is the last one admitted


def _blocked(prog: Any, src: str) -> Any:
    from gateway.datapath.maps import Maps

    flows = [f for f in _flows_from(Maps(prog), src) if f.blocked]
    assert len(flows) == 1, _flows_from(Maps(prog), src)
    return flows[0]


@pytest.mark.parametrize(
    ("size", "split"),
    [(16000, False), (0, False), (1000, True)],
    ids=["16k-frames", "empty-frames", "split-frame-headers"],
)
def test_continuation_flood_is_cut_at_the_header_block_bound(
    net: Net, prog: Any, size: int, split: bool
) -> None:
    from gateway.datapath.maps import Maps

    args = ["cont", "--target", net.target, "--source", net.other, "--timeout", "8"]
    r = net.peer(*args, "--size", str(size), *(["--split"] if split else []))
    assert r["outcome"] == "stalled", r  # no more ACKs: the flow is dropped, not served
    f = _blocked(prog, net.other)
    assert f.reason == "header_block"
    # What reached the server of that connection: preface, settings, one block up to the bound
    assert f.bytes <= MAX_HEADER_BLOCK + ONE_PACKET + 4096, f
    stats = Maps(prog).stats()
    assert stats["header_block_flows"] == 1 and stats["flood_drop"] > 0
    if split:  # frame headers cut across segments are carried over, not lost track of
        assert stats["h2_lost"] == 0, stats
    assert net.peer("grpc", "--target", net.target, "-n", "20")["ok"] == 20


def test_legitimate_multi_frame_header_blocks_pass(net: Net, prog: Any) -> None:
    from gateway.datapath.maps import Maps

    # 12 kB of metadata in 4 kB frames: HEADERS + CONTINUATION, under grpc's 16 KiB cap
    args = ["streams", "--target", net.target, "--source", net.good, "-n", "20"]
    r = net.peer(*args, "--metadata-bytes", "12000", "--timeout", "3")
    assert r["responses"] == 20, r
    assert not any(f.blocked for f in Maps(prog).flows())
    assert Maps(prog).stats()["header_block_flows"] == 0


def test_ping_flood_in_stuffed_packets_is_cut_at_once(net: Net, prog: Any) -> None:
    from gateway.datapath.maps import Maps

    args = ["ping", "--target", net.target, "--source", net.other, "--timeout", "8"]
    r = net.peer(*args, "-n", "500")
    assert r["outcome"] == "stalled", r
    f = _blocked(prog, net.other)
    assert f.reason == "ping_flood"
    # More PINGs in one packet than the walker counts: no client needs that, blocked at once.
    assert f.ping <= 64 and f.bytes <= 1000, f
    assert Maps(prog).stats()["ping_flood_flows"] == 1
    assert net.peer("grpc", "--target", net.target, "-n", "20")["ok"] == 20


def test_ping_budget_per_window(net: Net, prog: Any) -> None:
    from gateway.datapath.maps import Maps

    # A budget of 40 PINGs per 10 s; 30 per write: the second write goes over it. (With the
    # default budget of 1000, grpc's own ping strikes may close such a connection first.)
    Maps(prog).set_config(1.0, 0.8, 100, max_header_block=65536, ping_max=40, ping_window_s=10)
    args = ["ping", "--target", net.target, "--source", net.other, "--timeout", "8"]
    r = net.peer(*args, "-n", "30")
    assert r["outcome"] in ("stalled", "BrokenPipeError", "ConnectionResetError"), r
    f = _blocked(prog, net.other)
    assert f.reason == "ping_flood"
    assert 40 < f.ping <= 40 + 30 * 4, f  # the packet that crosses the budget may carry a few
    assert net.peer("grpc", "--target", net.target, "-n", "20")["ok"] == 20


def _established_from(net: Net, port: int) -> list[str]:
    """The server's established sockets whose peer port is `port`."""
    out = subprocess.run(
        ["ip", "netns", "exec", net.srv_ns, "ss", "-Htn", "state", "established",
         f"( dport = :{port} )"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [line for line in out.splitlines() if line.strip()]


async def test_sync_loop_closes_the_blocked_connection_on_the_server(net: Net) -> None:
    from gateway.datapath import Datapath
    from gateway.policy.model import Datapath as Policy
    from gateway.telemetry import metrics

    closed = "blocked_flows_closed"
    before = metrics.REGISTRY.get_sample_value("sluice_datapath_events_total", {"event": closed})
    policy = Policy(enabled=True, interface=net.srv_if, h2c_ports=[8081], sync_interval_s=0.1)
    dp = Datapath(policy, netns=net.srv_ns)
    await dp.start()
    try:
        args = ["cont", "--target", net.target, "--source", net.other, "--timeout", "8"]
        r = await asyncio.to_thread(net.peer, *args, "--size", "16000")
        # blocked (no ACKs), or already reset by the sync loop's SOCK_DESTROY
        assert r["outcome"] in ("stalled", "ConnectionResetError", "BrokenPipeError"), r
        deadline = time.monotonic() + 5
        while _established_from(net, r["port"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert _established_from(net, r["port"]) == []  # grpc's end is gone too
        after = metrics.REGISTRY.get_sample_value("sluice_datapath_events_total", {"event": closed})
        assert (after or 0) - (before or 0) == 1
        assert await asyncio.to_thread(net.peer, "grpc", "--target", net.target, "-n", "5") == {
            "ok": 5,
            "errors": [],
        }
    finally:
        await dp.stop(detach=True)


GATEWAY_POLICY = """\
version: 1
listeners:
  http: {host: 127.0.0.1, port: 8090}
  grpc: {host: 0.0.0.0, port: 8091}
  admin: {host: 127.0.0.1, port: 9901}
mock_backend: {enabled: true, ttft_ms: 0, token_delay_ms: 0}
backends:
  - {name: sim, protocol: grpc, endpoints: [{address: "127.0.0.1:18001"}]}
routes:
  - {name: grpc, match: {protocol: grpc}, backend: sim}
datapath:
  enabled: true
  required: true
  interface: IFACE
  h2c_ports: [8091]
  sync_interval_s: 0.2
"""


def _in_srv(net: Net, code: str, *args: str) -> str:
    out = subprocess.run(
        ["ip", "netns", "exec", net.srv_ns, sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=10,
    )  # fmt: skip
    return out.stdout if out.returncode == 0 else ""


def _admin(net: Net, path: str) -> str:
    code = (
        "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=2).read().decode())"
    )
    return _in_srv(net, code, f"http://127.0.0.1:9901{path}")


def _metric(text: str, name: str) -> float:
    lines = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_live_gateway_cuts_floods_and_keeps_serving(net: Net, tmp_path: Path) -> None:
    """`sluice serve` in the server namespace, its gRPC port behind the datapath."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(GATEWAY_POLICY.replace("IFACE", net.srv_if))
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115 - closed below
    gw = subprocess.Popen(
        ["ip", "netns", "exec", net.srv_ns, sys.executable, "-m", "gateway", "serve",
         "--policy", str(policy)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    target = f"{net.srv_ip}:8091"
    try:
        deadline = time.monotonic() + 60
        while not _admin(net, "/readyz").count('"ready": true'):
            assert gw.poll() is None, (tmp_path / "gateway.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()
            time.sleep(0.3)
        assert net.peer("grpc", "--target", target, "-n", "5", "--size", "0")["ok"] == 5
        cont = ["cont", "--target", target, "--source", net.other, "--timeout", "8"]
        r = net.peer(*cont, "--size", "16000")
        assert r["outcome"] in ("stalled", "ConnectionResetError", "BrokenPipeError"), r
        ping = ["ping", "--target", target, "--source", net.other, "--timeout", "8", "-n", "500"]
        r = net.peer(*ping)
        assert r["outcome"] in ("stalled", "ConnectionResetError", "BrokenPipeError"), r
        assert net.peer("grpc", "--target", target, "-n", "20", "--size", "0")["ok"] == 20
        deadline = time.monotonic() + 5
        while True:
            text = _admin(net, "/metrics")
            closed = _metric(text, 'sluice_datapath_events_total{event="blocked_flows_closed"}')
            if closed >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert _metric(text, 'sluice_datapath_events_total{event="header_block_flows"}') == 1
        assert _metric(text, 'sluice_datapath_events_total{event="ping_flood_flows"}') == 1
        assert closed == 2, text
    finally:
        gw.terminate()
        gw.wait(30)
        log.close()
