"""Private redis-server processes for tests (never the machine's Redis on 6379): one server
that can be stopped and started again on the same port (to test Redis going down), and a small
Redis Cluster that is only handed out once every node serves every slot."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support import free_port, require_binary, wait_for_port


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (so at most 55535)."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        cluster: bool = False,
        appendonly: bool = False,
    ) -> None:
        self.binary = require_binary("redis-server")
        self.appendonly = appendonly  # every write fsynced to the append-only file
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or (cluster_port() if cluster else free_port())
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.workdir),
            "--protected-mode", "no",
        ]  # fmt: skip
        if self.appendonly:
            args += ["--appendfsync", "always"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_for_port(self.port, timeout=30)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill it (as a crash would); returns once the port is free for a restart."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                wait_for_port(self.port, timeout=0.05)
            except TimeoutError:
                return
            time.sleep(0.05)
        raise TimeoutError(f"port {self.port} still answers after redis-server stopped")

    def restart(self) -> None:
        self.stop()
        self.start()


def cluster_info(cli: str, port: int) -> dict[str, str]:
    """`CLUSTER INFO` of one node as a dict ({} while it does not answer)."""
    try:
        out = subprocess.run(
            [cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=5
        ).stdout
    except subprocess.TimeoutExpired:
        return {}
    return dict(line.split(":", 1) for line in out.split() if ":" in line)


def start_cluster(workdir: Path, masters: int = 3, timeout: float = 30.0) -> list[RedisServer]:
    """`masters` cluster-enabled servers joined with `redis-cli --cluster create`, returned once
    every node knows every other one and reports all 16384 slots ok (`cluster_state:ok`): a
    node that still says CLUSTERDOWN would fail the first client that asks it."""
    cli = require_binary("redis-cli")
    nodes: list[RedisServer] = []
    try:
        for i in range(masters):  # one by one: a node that fails to start stops the others
            nodes.append(RedisServer(workdir / f"node{i}", cluster=True))
            nodes[-1].start()
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        want = {
            "cluster_state": "ok",
            "cluster_slots_ok": "16384",
            "cluster_known_nodes": str(masters),
            "cluster_size": str(masters),
        }
        deadline = time.monotonic() + timeout
        while True:
            infos = [cluster_info(cli, n.port) for n in nodes]
            if all(all(info.get(k) == v for k, v in want.items()) for info in infos):
                return nodes
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster not ok on every node: {infos}")
            time.sleep(0.1)
    except BaseException:
        for n in nodes:
            n.stop()
        raise


def serve_redis(workdir: Path) -> Iterator[RedisServer]:
    """A fixture's body: a private redis-server in `workdir`, stopped afterwards."""
    server = RedisServer(workdir).start()
    try:
        yield server
    finally:
        server.stop()
