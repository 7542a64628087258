"""A real DNS server for the DNS discovery tests: dnsmasq on a loopback port, answering from a
hosts file the test rewrites (`DnsServer.hosts`, re-read on SIGHUP) and from SRV records given
at start. Nothing is forwarded: a name it does not know gets NXDOMAIN."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from tests.support import free_port, require, wait_until


class DnsServer:
    def __init__(self, tmp: Path, domain: str = "sluice.test", srv: tuple[str, ...] = ()) -> None:
        require(shutil.which("dnsmasq") is not None, "dnsmasq not installed (dnsmasq-base)")
        self.tmp = tmp
        self.domain = domain
        self.srv = srv  # --srv-host values: name,target,port,priority,weight
        self.port = free_port()
        self.hosts_file = tmp / "hosts"
        self.hosts_file.write_text("")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DnsServer:
        args = [
            "dnsmasq", "--keep-in-foreground", "--user=root", "--port", str(self.port),
            "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
            "--no-negcache", f"--local=/{self.domain}/", f"--addn-hosts={self.hosts_file}",
            "--local-ttl=1", "--log-facility=-", "--pid-file=",
            *(f"--srv-host={s}" for s in self.srv),
        ]  # fmt: skip
        with open(self.tmp / "dnsmasq.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        wait_until(self._answers, timeout=10, what="dnsmasq answering")
        return self

    def _answers(self) -> bool:
        return self.addresses(f"probe.{self.domain}") is not None

    @property
    def resolver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def hosts(self, records: dict[str, list[str]]) -> None:
        """Answer these names (short names are in `domain`) with these addresses from now on."""
        lines = []
        for name, ips in records.items():
            fq = name if "." in name else f"{name}.{self.domain}"
            lines += [f"{ip} {fq}" for ip in ips]
        tmp = self.hosts_file.with_suffix(".new")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.hosts_file)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)  # re-read the hosts files (and drop its cache)
        want = {
            (n if "." in n else f"{n}.{self.domain}"): sorted(ips) for n, ips in records.items()
        }
        wait_until(lambda: all(self.addresses(n) == ips for n, ips in want.items()), timeout=10,
                   what="dnsmasq answering the new records")  # fmt: skip

    def addresses(self, name: str) -> list[str] | None:
        """The A records of `name` it answers now (None: no answer)."""
        import dns.message
        import dns.query

        q = dns.message.make_query(name, "A")
        try:
            r = dns.query.udp(q, "127.0.0.1", timeout=0.5, port=self.port)
        except (OSError, dns.exception.Timeout):
            return None
        return sorted(rr.address for rrset in r.answer for rr in rrset)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        self.proc = None
