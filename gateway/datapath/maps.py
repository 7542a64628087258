"""Typed reads and writes of the classifier's maps (layout: ebpf/sluice_maps.h).

Addresses are keyed as 16 bytes, IPv4 as IPv4-mapped IPv6 (::ffff:a.b.c.d), like the C side.
Times written into maps (deny expiry) are CLOCK_MONOTONIC nanoseconds: bpf_ktime_get_ns() reads
the same clock.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import DatapathError

# enum sluice_stat in sluice_maps.h, in order.
STAT_NAMES = (
    "packets",
    "bytes",
    "syn_drop",
    "stream_drop",
    "deny_drop",
    "rapid_reset_drop",
    "rapid_reset_flows",
    "h2_resync",
    "h2_lost",
    "deny_expired",
    "egress_packets",
    "egress_classified",
    "header_block_flows",
    "ping_flood_flows",
    "flood_drop",
    "h2_ooo_drop",
)
# flow_stats.blocked (BLOCK_* in sluice_maps.h) -> reason
BLOCK_REASONS = {1: "rapid_reset", 2: "header_block", 3: "ping_flood"}
PORT_H2C = 1
PORT_ADMIT = 2
MAX_CLASSES = 8


def addr16(ip: str) -> bytes:
    """The 16-byte key of an address: IPv6 as is, IPv4 mapped."""
    a = ipaddress.ip_address(ip)
    if isinstance(a, ipaddress.IPv4Address):
        return ipaddress.IPv6Address(f"::ffff:{a}").packed
    return a.packed


def addr_str(raw: bytes) -> str:
    a = ipaddress.IPv6Address(bytes(raw))
    return str(a.ipv4_mapped) if a.ipv4_mapped else str(a)


def monotonic_ns() -> int:
    """bpf_ktime_get_ns() domain."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass(frozen=True)
class Flow:
    src: str
    dst: str
    sport: int
    dport: int
    packets: int
    bytes: int
    headers: int
    data: int
    rst_stream: int
    settings: int
    ping: int
    blocked: bool
    reason: str | None = None  # why it is blocked: rapid_reset, header_block, ping_flood


@dataclass(frozen=True)
class Source:
    addr: str
    syns: int
    streams: int
    syn_drops: int
    stream_drops: int
    deny_drops: int


def _set_addr(key: Any, raw: bytes) -> Any:
    for i, b in enumerate(raw):
        key.addr[i] = b
    return key


class Maps:
    """The gateway's view of the classifier maps; `prog` is a loaded BpfProgram."""

    def __init__(self, prog: Any) -> None:
        self._t = prog.table

    # -- configuration (written from the policy) -----------------------------------------
    def set_ports(self, h2c: Iterable[int], admission: Iterable[int]) -> None:
        h2c, admission = set(h2c), set(admission) or set(h2c)
        t = self._t("ports")
        wanted = {p: (PORT_H2C if p in h2c else 0) | (PORT_ADMIT if p in admission else 0)
                  for p in h2c | admission}  # fmt: skip
        for k in list(t.keys()):
            if k.value not in wanted:
                del t[k]
        for port, flags in wanted.items():
            t[t.Key(port)] = t.Leaf(flags)

    def set_budget(
        self,
        syn: tuple[int, int],
        stream: tuple[int, int],
        source: str | None = None,
    ) -> None:
        """(rate, burst) for SYNs and streams; source None = the default for every source."""
        t = self._t("budgets")
        key = _set_addr(t.Key(), addr16(source) if source else bytes(16))
        leaf = t.Leaf()
        leaf.syn_rate, leaf.syn_burst = syn[0], syn[1] or syn[0]
        leaf.stream_rate, leaf.stream_burst = stream[0], stream[1] or stream[0]
        t[key] = leaf

    def set_config(
        self,
        rr_window_s: float,
        rr_ratio: float,
        rr_min_headers: int,
        max_frame: int = 1 << 24,
        *,
        max_header_block: int = 0,
        ping_max: int = 0,
        ping_window_s: float = 1.0,
    ) -> None:
        """Run-time thresholds; max_header_block / ping_max 0 = that check is off."""
        t = self._t("config")
        leaf = t.Leaf()
        leaf.rr_window_ns = int(rr_window_s * 1e9)
        leaf.rr_min_headers = rr_min_headers
        leaf.rr_ratio_pct = int(round(rr_ratio * 100))
        leaf.max_frame = max_frame - 1
        leaf.max_header_block = max_header_block
        leaf.ping_max = ping_max
        leaf.ping_window_ns = int(ping_window_s * 1e9)
        t[t.Key(0)] = leaf

    def set_classes(self, class_priority: Mapping[str, int], port_class: Mapping[int, str]) -> None:
        """Class index = position in sorted class names (stable across restarts)."""
        names = sorted(class_priority)
        if len(names) > MAX_CLASSES:
            raise DatapathError(f"at most {MAX_CLASSES} priority classes, got {len(names)}")
        t = self._t("classes")
        for i in range(MAX_CLASSES):
            leaf = t.Leaf()
            leaf.priority = class_priority[names[i]] if i < len(names) else 0
            leaf.mark = 0
            t[t.Key(i)] = leaf
        pc = self._t("port_class")
        for k in list(pc.keys()):
            del pc[k]
        for port, cls in port_class.items():
            if cls not in class_priority:
                raise DatapathError(f"port_class {port}: unknown priority class {cls!r}")
            pc[pc.Key(port)] = pc.Leaf(names.index(cls))

    def set_source_class(self, source: str, cls_index: int | None) -> None:
        t = self._t("src_class")
        key = _set_addr(t.Key(), addr16(source))
        if cls_index is None:
            t.pop(key, None)
        else:
            t[key] = t.Leaf(cls_index)

    # -- deny list -----------------------------------------------------------------------
    def deny(self, source: str, ttl_s: float) -> int:
        """Drop `source` on admission ports for ttl_s; returns the expiry (monotonic ns)."""
        t = self._t("deny")
        expiry = monotonic_ns() + int(ttl_s * 1e9)
        t[_set_addr(t.Key(), addr16(source))] = t.Leaf(expiry)
        return expiry

    def undeny(self, source: str) -> None:
        t = self._t("deny")
        t.pop(_set_addr(t.Key(), addr16(source)), None)

    def denied(self) -> dict[str, float]:
        """Live deny entries: source -> seconds left (expired ones are removed here too)."""
        t = self._t("deny")
        now = monotonic_ns()
        out: dict[str, float] = {}
        for k, v in list(t.items()):
            if v.value <= now:
                t.pop(k, None)
            else:
                out[addr_str(bytes(k.addr))] = (v.value - now) / 1e9
        return out

    # -- counters ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        t = self._t("stats")
        out = {}
        for i, name in enumerate(STAT_NAMES):
            out[name] = int(sum(t[t.Key(i)]))
        return out

    def flows(self) -> list[Flow]:
        out = []
        for k, v in self._t("flows").items():
            out.append(
                Flow(
                    addr_str(bytes(k.saddr)),
                    addr_str(bytes(k.daddr)),
                    int(k.sport),
                    int(k.dport),
                    int(v.packets),
                    int(v.bytes),
                    int(v.headers),
                    int(v.data),
                    int(v.rst_stream),
                    int(v.settings),
                    int(v.ping),
                    bool(v.blocked),
                    BLOCK_REASONS.get(int(v.blocked)),
                )
            )
        return out

    def sources(self) -> list[Source]:
        return [
            Source(
                addr_str(bytes(k.addr)),
                int(v.syns),
                int(v.streams),
                int(v.syn_drops),
                int(v.stream_drops),
                int(v.deny_drops),
            )
            for k, v in self._t("sources").items()
        ]

    def apply_policy(self, dp: Any) -> None:
        """Write everything a `policy.model.Datapath` sets at run time."""
        self.set_ports(dp.h2c_ports, dp.admission_ports)
        self.set_budget(
            (dp.syn_budget.rate, dp.syn_budget.burst),
            (dp.stream_budget.rate, dp.stream_budget.burst),
        )
        self.set_config(
            dp.rapid_reset_window_s,
            dp.rapid_reset_ratio,
            dp.rapid_reset_min_headers,
            max_header_block=dp.max_header_block_bytes,
            ping_max=dp.ping_flood_max,
            ping_window_s=dp.ping_flood_window_s,
        )
        self.set_classes(dp.class_priority, dp.port_class)


def build_options(dp: Any) -> Any:
    """cflags-carrying options of a `policy.model.Datapath`."""
    from gateway.datapath.loader import BuildOptions

    return BuildOptions(max_flows=dp.max_flows, max_sources=dp.max_sources, max_deny=dp.max_deny)
