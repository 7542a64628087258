"""`sluice host plan|apply|rollback`: TCP host tuning for a gateway in front of LLM backends.

plan      current vs desired values, and what this kernel supports (fallback chains: bbr2 is not in
          mainline, so bbr2 -> bbr3 -> bbr -> cubic; fq_pie -> fq -> fq_codel, probed by creating
          the qdisc on a veth in a scratch network namespace)
apply     sets what differs and first writes a rollback file with the exact previous values
rollback  restores every recorded value, then removes the rollback file

With --netns the whole command runs inside that network namespace (setns), where the per-netns
settings (tcp_congestion_control, tcp_notsent_lowat, tcp_rmem/wmem, core rmem/wmem_max on recent
kernels) are the namespace's own; global ones that the namespace does not expose
(net.core.default_qdisc) are reported and left alone.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.errors import HostTuneError

CC_PREFERENCE = ("bbr2", "bbr3", "bbr", "cubic")
QDISC_PREFERENCE = ("fq_pie", "fq", "fq_codel")
# Cloudflare/Google guidance for latency-sensitive streaming: keep little unsent data queued in
# the socket so prioritised frames are not stuck behind it (tcp_notsent_lowat, 16 KiB).
NOTSENT_LOWAT = "16384"
BUF_MAX = "16777216"  # 16 MiB: enough for a 1 Gbit/s x 100 ms path
SYSCTLS = {
    "net.ipv4.tcp_congestion_control": None,  # from the CC fallback chain
    "net.core.default_qdisc": None,  # from the qdisc fallback chain
    "net.ipv4.tcp_notsent_lowat": NOTSENT_LOWAT,
    "net.core.rmem_max": BUF_MAX,
    "net.core.wmem_max": BUF_MAX,
    "net.ipv4.tcp_rmem": f"4096 131072 {BUF_MAX}",
    "net.ipv4.tcp_wmem": f"4096 16384 {BUF_MAX}",
}
DEFAULT_ROLLBACK = Path("/var/lib/sluice/host-rollback.json")
CLONE_NEWNET = 0x40000000
# Root qdiscs the kernel attaches by itself (handle 0:): rollback deletes ours to get them back.
AUTO_HANDLE = "0:"


@dataclass
class Item:
    name: str
    current: str | None
    desired: str | None
    note: str = ""

    @property
    def change(self) -> bool:
        return (
            self.current is not None and self.desired is not None and self.current != self.desired
        )


def _proc(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctl(name: str) -> str | None:
    """Value with whitespace normalised; None when this namespace does not expose it."""
    try:
        return " ".join(_proc(name).read_text().split())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise HostTuneError(f"cannot read {name}: {exc}") from exc


def write_sysctl(name: str, value: str) -> None:
    try:
        _proc(name).write_text(value.replace(" ", "\t") + "\n")
    except OSError as exc:
        raise HostTuneError(f"cannot set {name} = {value}: {exc}") from exc
    if read_sysctl(name) != " ".join(value.split()):
        raise HostTuneError(f"{name} did not take {value!r} (now {read_sysctl(name)!r})")


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        r = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=10)
    except FileNotFoundError as exc:
        raise HostTuneError("the tc binary (iproute2) is missing") from exc
    if check and r.returncode != 0:
        raise HostTuneError(f"tc {' '.join(args)}: {r.stderr.strip()}")
    return r


def root_qdisc(iface: str) -> dict[str, Any]:
    r = _tc("-j", "qdisc", "show", "dev", iface, "root")
    rows = [q for q in json.loads(r.stdout or "[]") if q.get("root")]
    if not rows:  # a device that is down has none until it is opened
        return {"kind": "none", "handle": AUTO_HANDLE}
    return {"kind": rows[0]["kind"], "handle": rows[0].get("handle", AUTO_HANDLE)}


def available_ccs() -> list[str]:
    avail = (read_sysctl("net.ipv4.tcp_available_congestion_control") or "").split()
    missing = [cc for cc in CC_PREFERENCE if cc not in avail]
    modprobe = shutil.which("modprobe") or shutil.which("modprobe", path="/sbin:/usr/sbin")
    if missing and modprobe:  # best effort: modules load on demand where modprobe exists
        for cc in missing:
            subprocess.run([modprobe, "-q", f"tcp_{cc}"], capture_output=True, check=False)
        avail = (read_sysctl("net.ipv4.tcp_available_congestion_control") or "").split()
    return avail


def probe_qdiscs(kinds: tuple[str, ...]) -> dict[str, bool]:
    """Which qdisc kinds this kernel can create: tried on a veth in a scratch netns."""
    ns = f"sluice-probe-{secrets.token_hex(3)}"
    out = {k: False for k in kinds}
    r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, check=False)
    if r.returncode != 0:
        raise HostTuneError(f"cannot create a scratch netns to probe qdiscs: {r.stderr!r}")
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                       capture_output=True, check=True)  # fmt: skip
        for k in kinds:
            r = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", "p0", "root", k],
                               capture_output=True, check=False)  # fmt: skip
            out[k] = r.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    return out


def enter_netns(name: str) -> None:
    """Move this (single-threaded CLI) process into a named network namespace."""
    path = Path("/run/netns") / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise HostTuneError(f"no network namespace {name!r}: {exc}") from exc
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise HostTuneError(f"setns({name}): {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def plan(iface: str | None, qdisc_pref: tuple[str, ...] = QDISC_PREFERENCE) -> list[Item]:
    items: list[Item] = []
    ccs = available_ccs()
    cc = next((c for c in CC_PREFERENCE if c in ccs), None)
    q_ok = probe_qdiscs(qdisc_pref)
    qd = next((q for q in qdisc_pref if q_ok[q]), None)
    for name, value in SYSCTLS.items():
        current = read_sysctl(name)
        note = ""
        if current is not None and value is not None and name.endswith("mem_max"):
            value = str(max(int(current), int(value)))  # raise limits, never shrink them
        elif current is not None and value is not None and name.endswith(("rmem", "wmem")):
            cur, want = current.split(), value.split()
            value = " ".join([*cur[:2], str(max(int(cur[2]), int(want[2])))])
        if name.endswith("congestion_control"):
            value = cc
            note = f"available: {' '.join(ccs)}; preference {' > '.join(CC_PREFERENCE)}"
        elif name.endswith("default_qdisc"):
            value = qd
            note = "supported: " + (" ".join(k for k, v in q_ok.items() if v) or "none of")
            note += f" ({' > '.join(qdisc_pref)})"
        if current is None:
            note = "not exposed in this network namespace (global): left alone"
            value = None
        elif _proc(name).stat().st_mode & 0o222 == 0:
            note = "read-only in this network namespace (set it in the host's): left alone"
            value = None
        elif value is None:
            note += ": nothing supported, keep current"
        items.append(Item(name, current, value, note))
    if iface:
        root = root_qdisc(iface)
        items.append(
            Item(f"qdisc:{iface}", root["kind"], qd, "root qdisc" if qd else "none supported")
        )
    return items


def apply(iface: str | None, rollback_file: Path, qdisc_pref: tuple[str, ...]) -> list[Item]:
    if rollback_file.exists():
        raise HostTuneError(
            f"{rollback_file} exists: roll back first (it holds the values before the last apply)"
        )
    items = plan(iface, qdisc_pref)
    record: dict[str, Any] = {"created": time.time(), "sysctl": {}, "qdisc": None}
    for it in items:
        if not it.change:
            continue
        if it.name.startswith("qdisc:"):
            record["qdisc"] = {"iface": iface, **root_qdisc(iface or "")}
        else:
            record["sysctl"][it.name] = it.current
    rollback_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = rollback_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    tmp.replace(rollback_file)  # the file is complete before anything changes
    try:
        for it in items:
            if not it.change or it.desired is None:
                continue
            if it.name.startswith("qdisc:"):
                _tc("qdisc", "replace", "dev", iface or "", "root", it.desired)
            else:
                write_sysctl(it.name, it.desired)
    except HostTuneError as exc:
        try:  # all or nothing: put back what was already changed
            rollback(rollback_file)
        except HostTuneError as again:
            raise HostTuneError(f"{exc}; rolling back failed too: {again}") from exc
        raise HostTuneError(f"{exc} (everything already applied was rolled back)") from exc
    return items


def rollback(rollback_file: Path) -> dict[str, Any]:
    try:
        record: dict[str, Any] = json.loads(rollback_file.read_text())
    except FileNotFoundError as exc:
        raise HostTuneError(f"no rollback file at {rollback_file}: nothing to roll back") from exc
    # sysctls first: deleting a root qdisc makes the kernel attach default_qdisc again.
    for name, value in record["sysctl"].items():
        write_sysctl(name, value)
    q = record.get("qdisc")
    if q:
        if q["handle"] == AUTO_HANDLE:
            _tc("qdisc", "del", "dev", q["iface"], "root", check=False)
        else:
            _tc("qdisc", "replace", "dev", q["iface"], "root", "handle", q["handle"], q["kind"])
        now = root_qdisc(q["iface"])
        if now["kind"] != q["kind"]:
            raise HostTuneError(f"root qdisc of {q['iface']} is {now['kind']}, not {q['kind']}")
    rollback_file.unlink()
    return record


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["plan", "apply", "rollback"])
    parser.add_argument("--iface", default=None, help="interface whose root qdisc is tuned")
    parser.add_argument("--netns", default=None, help="run inside this network namespace")
    parser.add_argument("--rollback-file", type=Path, default=DEFAULT_ROLLBACK)
    parser.add_argument(
        "--qdisc-preference",
        default=",".join(QDISC_PREFERENCE),
        help="qdisc fallback chain, best first",
    )
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    pref = tuple(q for q in args.qdisc_preference.split(",") if q)
    try:
        if args.netns:
            enter_netns(args.netns)
        if args.action == "rollback":
            rec = rollback(args.rollback_file)
            print(json.dumps(rec) if args.json else f"restored from {args.rollback_file}")
            return 0
        if args.action == "apply" and os.geteuid() != 0:
            raise HostTuneError("apply needs root")
        items = (apply if args.action == "apply" else lambda i, _f, p: plan(i, p))(
            args.iface, args.rollback_file, pref
        )
    except HostTuneError as exc:
        print(f"sluice host {args.action}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{**asdict(i), "change": i.change} for i in items], indent=2))
    else:
        verb = "set" if args.action == "apply" else "change"
        for i in items:
            mark = verb if i.change else "keep"
            print(f"{mark:6} {i.name:34} {i.current!s:>28} -> {i.desired!s:28} {i.note}")
        if args.action == "apply":
            print(f"rollback file: {args.rollback_file}")
    return 0
