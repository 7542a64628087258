"""SOCK_DESTROY of one TCP socket (what the sync loop does to a flow the kernel blocked)."""

from __future__ import annotations

import socket
import struct

import pytest

from gateway.datapath.reset import SOCK_DESTROY, destroy, destroy_request
from tests.support import require_root


def test_request_layout() -> None:
    msg = destroy_request(("10.0.0.1", 8081), ("10.0.0.3", 40000), seq=7)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", msg)
    assert (length, kind, flags, seq) == (len(msg), SOCK_DESTROY, 0x5, 7) and length == 72
    family, proto = msg[16], msg[17]
    assert (family, proto) == (socket.AF_INET, socket.IPPROTO_TCP)
    sport, dport = struct.unpack_from(">HH", msg, 24)
    assert (sport, dport) == (8081, 40000)
    assert msg[28:32] == bytes([10, 0, 0, 1]) and msg[44:48] == bytes([10, 0, 0, 3])
    mapped = destroy_request(("::ffff:10.0.0.1", 1), ("::ffff:10.0.0.3", 2))
    assert mapped[16] == socket.AF_INET  # the flow table's IPv4-mapped keys
    assert destroy_request(("::1", 1), ("::1", 2))[16] == socket.AF_INET6
    with pytest.raises(ValueError):
        destroy_request(("10.0.0.1", 1), ("::1", 2))


def test_destroy_aborts_the_server_end_of_a_live_connection() -> None:
    require_root()  # CAP_NET_ADMIN
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        server, peer = listener.accept()
        with client, server:
            assert destroy(("127.0.0.1", port), peer) is True
            server.settimeout(2)
            with pytest.raises(OSError):  # ECONNABORTED on the owner's next read
                server.recv(1)
    assert destroy(("127.0.0.1", port), ("127.0.0.1", 9)) is False  # no such socket
