"""Close the local end of a TCP connection the classifier has blocked (netlink SOCK_DESTROY).

A blocked flow gets no packet through, but the server that owns its socket (grpc) does not know:
it keeps the connection, and what it buffered for it, until TCP gives up on the retransmissions
its peer never acknowledges (tcp_retries2, ~15 min). SOCK_DESTROY (sock_diag, kernel
CONFIG_INET_DIAG_DESTROY, CAP_NET_ADMIN) aborts the socket at once: its owner sees ECONNABORTED
and frees the connection. Blocking, so call it from a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Iterator

NETLINK_SOCK_DIAG = 4
SOCK_DESTROY = 21
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
CLONE_NEWNET = 0x40000000
ALL_STATES = 0xFFFFFFFF
TIMEOUT_S = 1.0


def _addr(ip: str) -> tuple[int, bytes]:
    """(family, 16-byte idiag address) of an address; IPv4-mapped IPv6 counts as IPv4."""
    a = ipaddress.ip_address(ip)
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    if isinstance(a, ipaddress.IPv4Address):
        return socket.AF_INET, a.packed + bytes(12)
    return socket.AF_INET6, a.packed


def destroy_request(local: tuple[str, int], remote: tuple[str, int], seq: int = 1) -> bytes:
    """The SOCK_DESTROY message for the socket bound to `local` and connected to `remote`
    (struct nlmsghdr + struct inet_diag_req_v2, include/uapi/linux/inet_diag.h)."""
    family, src = _addr(local[0])
    family_r, dst = _addr(remote[0])
    if family != family_r:
        raise ValueError(f"address families differ: {local[0]} and {remote[0]}")
    sockid = struct.pack(">HH", local[1], remote[1]) + src + dst
    sockid += struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, ALL_STATES) + sockid
    header = struct.pack("=IHHII", 16 + len(req), SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, seq, 0)
    return header + req


@contextlib.contextmanager
def _in_netns(name: str | None) -> Iterator[None]:
    """Run the block with this thread in network namespace `name` (ip netns), then return."""
    if name is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {name}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # a thread left elsewhere would be worse
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)


def destroy(local: tuple[str, int], remote: tuple[str, int], netns: str | None = None) -> bool:
    """Abort the TCP socket local <-> remote. True if one was destroyed, False if none exists;
    OSError when the kernel refuses (no CAP_NET_ADMIN, or no CONFIG_INET_DIAG_DESTROY)."""
    with _in_netns(netns):
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    with sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendto(destroy_request(local, remote), (0, 0))
        reply = sock.recv(4096)
    if len(reply) < 20:
        raise OSError(errno.EPROTO, "short sock_diag reply")
    _, kind = struct.unpack_from("=IH", reply)
    if kind != NLMSG_ERROR:
        raise OSError(errno.EPROTO, f"unexpected sock_diag reply type {kind}")
    (code,) = struct.unpack_from("=i", reply, 16)
    if code == 0:
        return True
    if -code == errno.ENOENT:
        return False
    raise OSError(-code, f"SOCK_DESTROY: {os.strerror(-code)}")
