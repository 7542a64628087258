"""Members from DNS (`discovery.dns`): the lookup loop of one backend's section, with
dnspython's asyncio resolver. A Kubernetes headless Service answers one A/AAAA record per ready
pod (and SRV records per named port), which is what nginx's `resolver`, Envoy's `STRICT_DNS` and
gRPC's dns resolver read too.

The decisions (members from an answer, keeping the last ones on a failed or empty lookup, when
to look up again) are `gateway.core.dnsmembers`'s. A failed or empty lookup is logged once per
change, counted (`sluice_dns_lookups_total{result="error"|"empty"}`), and shown in
`/admin/state` (`registry.up` false, `kept` true) and `sluice_registry_up`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from gateway.core.dnsmembers import (
    Found,
    SrvRecord,
    from_addresses,
    from_srv,
    judge,
    next_delay,
)
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.policy.backends import DnsDiscovery
    from gateway.registry.member import MemberBooks
    from gateway.services import Services

log = logging.getLogger("sluice.registry")


def resolver_for(cfg: DnsDiscovery) -> dns.asyncresolver.Resolver:
    """The section's resolvers (ip or ip:port; names are then absolute), or the system's
    (resolv.conf, with its search list)."""
    if not cfg.resolvers:
        r = dns.asyncresolver.Resolver()
        # resolv.conf's search list and ndots, as the system resolver (and nginx, Envoy) use
        # them: in a Kubernetes pod, `vllm` is the headless Service of the pod's namespace.
        r.use_search_by_default = True
    else:
        r = dns.asyncresolver.Resolver(configure=False)
        servers: list[str | dns.nameserver.Nameserver] = []
        for spec in cfg.resolvers:
            host, port = spec, 53
            if spec.startswith("["):
                host, _, rest = spec[1:].partition("]")
                port = int(rest[1:]) if rest.startswith(":") else 53
            elif spec.count(":") == 1:
                host, _, p = spec.partition(":")
                port = int(p)
            servers.append(dns.nameserver.Do53Nameserver(host, port))
        r.nameservers = servers
    r.timeout = r.lifetime = cfg.timeout_s
    r.cache = None  # every lookup asks the server: its answer is the membership
    return r


class LookupFailed(Exception):
    """The DNS server did not answer (timeout, SERVFAIL, refused, no server)."""


async def _records(
    r: dns.asyncresolver.Resolver, name: str, rdtype: str
) -> tuple[list[Any], float | None]:
    """The records of one type (none when the name or the type has none) and their TTL."""
    try:
        ans = await r.resolve(name, rdtype, raise_on_no_answer=False)
    except dns.resolver.NXDOMAIN:
        return [], None
    except (dns.exception.DNSException, OSError) as e:
        raise LookupFailed(f"{rdtype} {name}: {type(e).__name__}: {e}"[:200]) from e
    if ans.rrset is None:
        return [], None
    return list(ans.rrset), float(ans.rrset.ttl)


async def _addresses(r: dns.asyncresolver.Resolver, name: str) -> tuple[list[str], float | None]:
    (a, ta), (aaaa, taaaa) = await asyncio.gather(_records(r, name, "A"), _records(r, name, "AAAA"))
    ttls = [t for t in (ta, taaaa) if t is not None]
    return [x.address for x in a + aaaa], min(ttls) if ttls else None


async def lookup(
    r: dns.asyncresolver.Resolver, cfg: DnsDiscovery
) -> tuple[dict[str, Found], float | None]:
    """The members the section's records give now, and the answer's smallest TTL."""
    if cfg.name is not None:
        ips, ttl = await _addresses(r, cfg.name)
        return from_addresses(ips, cfg.port, cfg.weight, cfg.priority, cfg.max_members), ttl
    assert cfg.srv is not None
    srvs, ttl = await _records(r, cfg.srv, "SRV")
    srvs = srvs[: cfg.max_members]
    got = await asyncio.gather(*(_addresses(r, s.target.to_text()) for s in srvs))
    ttls = [t for t in [ttl, *(t for _, t in got)] if t is not None]
    recs = [SrvRecord(s.priority, s.weight, s.port, tuple(ips))
            for s, (ips, _) in zip(srvs, got, strict=True)]  # fmt: skip
    return from_srv(recs, cfg.max_members), min(ttls) if ttls else None


class DnsWatcher:
    """Looks one backend's `discovery.dns` section up again and again; `found` (address →
    weight, priority) is what the backend's views read (as `Watcher.found` for heartbeats).
    Shared by every view with the same section."""

    source = "dns"

    def __init__(self, services: Services, pool: MemberBooks, backend: str,
                 cfg: DnsDiscovery) -> None:  # fmt: skip
        self.services = services
        self.pool = pool
        self.backend = backend
        self.cfg = cfg
        self.resolver = resolver_for(cfg)
        self.found: Mapping[str, Found] = {}
        self.fresh_until: dict[str, float] = {}  # (heartbeats only: DNS members do not age)
        self.up: bool | None = None  # None: not looked up yet
        self.kept = False  # the last lookup failed or was empty: the members before it stay
        self.error = ""
        self.looked_at: float | None = None
        self.ttl: float | None = None
        self.task: asyncio.Task[None] | None = None

    def placement(self, address: str) -> tuple[int, int]:
        f = self.found[address]
        return f.weight, f.priority

    async def lookup_once(self) -> float:
        """One lookup; returns the seconds until the next."""
        cfg = self.cfg
        try:
            answer, ttl = await lookup(self.resolver, cfg)
        except LookupFailed as e:
            self.update(None, str(e))
            return next_delay(None, cfg.interval_s, True)
        self.ttl = ttl
        self.update(answer, "" if answer else "empty answer")
        return next_delay(ttl, cfg.interval_s, not answer)

    def update(self, answer: Mapping[str, Found] | None, error: str) -> None:
        j = judge(self.found, answer)
        result = "error" if answer is None else ("empty" if not answer else "ok")
        metrics.DNS_LOOKUPS.labels(self.backend, result).inc()
        self.looked_at = self.services.clock.now()
        was_up = self.up
        self.up, self.kept, self.error = not j.kept, j.kept, error
        if j.kept:
            if was_up is not False:
                log.warning("backend %s: DNS lookup of %s failed (%s), keeping %d members",
                            self.backend, self.cfg.name or self.cfg.srv, error,
                            len(self.found))  # fmt: skip
        elif was_up is False:
            log.info("backend %s: DNS answers again (%d members)", self.backend, len(j.members))
        if j.changed:
            gone = [a for a in self.found if a not in j.members]
            new = [a for a in j.members if a not in self.found]
            log.info("backend %s: DNS members %d (+%s -%s)", self.backend, len(j.members),
                     ",".join(new) or "0", ",".join(gone) or "0")  # fmt: skip
            self.found = j.members
        if j.changed or was_up != self.up:
            self.pool.changed()

    def state(self) -> dict[str, object]:
        return {"source": "dns", "name": self.cfg.name or self.cfg.srv, "up": self.up,
                "kept": self.kept, "error": self.error, "looked_up_at": self.looked_at,
                "ttl_s": self.ttl, "members": len(self.found)}  # fmt: skip

    async def run(self) -> None:
        while not self.services.closed:
            delay = await self.lookup_once()
            await asyncio.sleep(delay)

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = self.services.spawn(self.run(), f"dns:{self.backend}")

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
