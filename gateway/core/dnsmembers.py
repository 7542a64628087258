"""DNS discovery's decisions: which members an answer gives, whether to keep the last ones, and
when to look up again. Pure: the lookup itself is `gateway.registry.dns`'s.

- **Members**: `name` → one per A/AAAA address, on the section's port, weight and priority;
  `srv` → one per address of each SRV target, on the record's port, with the record's weight
  (0 counts as 1) and its priority as a level (the lowest SRV priority is level 0, the next 1,
  ... up to 7, as SRV clients try the lowest first).
- **Never empty a pool on a blip**: a failed lookup, or one that answers no address at all,
  keeps the last known members (and says so); only an answer with addresses replaces them, and
  a member that leaves it drains (its requests in flight finish; it gets no new one).
- **When again**: the answer's smallest TTL, at most `interval_s`, at least `MIN_S` (a TTL of 0
  must not turn into a lookup storm); after a failure, sooner: `min(interval_s, RETRY_S)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MIN_S = 1.0
RETRY_S = 1.0
MAX_LEVEL = 7


@dataclass(frozen=True, slots=True)
class Found:
    """One member an answer gives: its weight and priority level."""

    weight: int
    priority: int


@dataclass(frozen=True, slots=True)
class SrvRecord:
    priority: int
    weight: int
    port: int
    addresses: tuple[str, ...]  # of its target


def address(ip: str, port: int) -> str:
    """host:port with an IPv6 address in brackets (as endpoints are written)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def from_addresses(ips: Iterable[str], port: int, weight: int, priority: int,
                   limit: int) -> dict[str, Found]:  # fmt: skip
    out: dict[str, Found] = {}
    for ip in sorted(set(ips)):
        if len(out) >= limit:
            break
        out[address(ip, port)] = Found(weight, priority)
    return out


def from_srv(records: Iterable[SrvRecord], limit: int) -> dict[str, Found]:
    recs = sorted(records, key=lambda r: (r.priority, -r.weight, r.port))
    levels = {p: min(i, MAX_LEVEL) for i, p in enumerate(sorted({r.priority for r in recs}))}
    out: dict[str, Found] = {}
    for r in recs:
        for ip in sorted(set(r.addresses)):
            a = address(ip, r.port)
            if a in out:
                continue
            if len(out) >= limit:
                return out
            out[a] = Found(max(r.weight, 1), levels[r.priority])
    return out


@dataclass(frozen=True, slots=True)
class Judged:
    members: Mapping[str, Found]
    kept: bool  # the last known members stay (the lookup failed or was empty)
    changed: bool  # the members differ from before


def judge(last: Mapping[str, Found], answer: Mapping[str, Found] | None) -> Judged:
    """The members after a lookup (`answer` None: it failed)."""
    if not answer:
        return Judged(last, True, False)
    return Judged(answer, False, dict(answer) != dict(last))


def next_delay(ttl: float | None, interval_s: float, failed: bool) -> float:
    """Seconds until the next lookup (see the module docstring)."""
    if failed:
        return min(interval_s, RETRY_S)
    if ttl is None:
        return interval_s
    return min(interval_s, max(MIN_S, ttl))
