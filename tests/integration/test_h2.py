"""HTTP/2 on the HTTP listener (h2c with prior knowledge), with real clients: httpx, curl,
h2load, and a scripted h2 client for a stream that stops reading. The gateway and the simulated
backend are real processes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import pytest
from hyperframe.frame import DataFrame, GoAwayFrame

from tests.integration.conftest import Backend
from tests.integration.h2_support import (
    CHAT,
    H2Gateway,
    RawH2,
    exchange,
    frame,
    start_h2_gateway,
)
from tests.support import require_binary, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gw(backend: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[H2Gateway]:
    g = start_h2_gateway(backend, tmp_path_factory.mktemp("h2gw"))
    try:
        yield g
    finally:
        assert g.proc.stop() == 0, g.proc.output()


def client() -> httpx.Client:
    return httpx.Client(http1=False, http2=True, timeout=10)  # h2c needs prior knowledge


def test_httpx_json_over_h2c(gw: H2Gateway) -> None:
    with client() as c:
        for _ in range(3):  # several streams on one connection
            r = c.post(f"{gw.url}/v1/chat/completions", json=CHAT)
            assert r.http_version == "HTTP/2"
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            assert r.headers["x-request-id"]
            assert int(r.headers["content-length"]) == len(r.content)


def test_httpx_sse_stream_over_h2c(gw: H2Gateway) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 6}
    with client() as c, c.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r:
        assert r.http_version == "HTTP/2"
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 6


def test_httpx_concurrent_streams_one_connection(gw: H2Gateway) -> None:
    async def run() -> list[int]:
        import asyncio

        async with httpx.AsyncClient(http1=False, http2=True, timeout=10) as c:
            rs = await asyncio.gather(
                *(c.post(f"{gw.url}/v1/chat/completions", json=CHAT) for _ in range(30))
            )
            return [r.status_code for r in rs]

    import asyncio

    assert asyncio.run(run()) == [200] * 30


def test_a_bearer_token_never_reaches_the_log_at_debug(backend: Backend, tmp_path: Path) -> None:
    """At `--log-level DEBUG` no client's token reaches the log: HPACK decodes a never-indexed
    `authorization` field on every HTTP/2 request, and hpack's decoder logs each field it decodes
    at DEBUG, its value in clear (this test fails with hpack's own logger in place)."""
    curl = require_binary("curl")
    g = start_h2_gateway(backend, tmp_path, log_level="DEBUG")
    token = "eyJhbGciOiJIUzI1NiJ9.c2VjcmV0LXBheWxvYWQtb2YtdGhlLXRlc3Q." + "Zk9x_-" * 12
    try:
        with client() as c:
            for _ in range(2):  # the second request finds the first's fields indexed
                r = c.post(f"{g.url}/v1/chat/completions", json=CHAT,
                           headers={"authorization": f"Bearer {token}"})  # fmt: skip
                assert r.http_version == "HTTP/2" and r.status_code == 200, r.text
        out = subprocess.run(
            [curl, "-sS", "--http2-prior-knowledge", "-m", "10", "-o", "/dev/null",
             "-w", "%{http_version} %{http_code}", "-H", f"authorization: Bearer {token}",
             "-H", "content-type: application/json", "-d", json.dumps(CHAT),
             f"{g.url}/v1/chat/completions"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
        assert out == "2 200", out
    finally:
        assert g.proc.stop() == 0, g.proc.output()
    log = g.proc.output()
    assert "access" in log or "bytes_out" in log  # the requests were logged (access log)
    assert token not in log and token[-30:] not in log


def test_curl_prior_knowledge_json_and_sse(gw: H2Gateway) -> None:
    curl = require_binary("curl")
    base = [curl, "-sS", "--http2-prior-knowledge", "-m", "10",
            "-H", "content-type: application/json"]  # fmt: skip
    out = subprocess.run(
        [
            *base,
            "-w",
            "\n%{http_version} %{http_code}",
            "-d",
            json.dumps(CHAT),
            f"{gw.url}/v1/chat/completions",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=20,
        check=True,  # fmt: skip
    ).stdout
    body, _, tail = out.rpartition("\n")
    assert tail == "2 200"
    assert json.loads(body)["object"] == "chat.completion"
    sse = subprocess.run(
        [*base, "-N", "-d", json.dumps({**CHAT, "stream": True}), f"{gw.url}/v1/chat/completions"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,  # fmt: skip
    ).stdout
    assert sse.rstrip().endswith("data: [DONE]")
    assert sse.count("data: ") >= 5


def test_http11_still_served_beside_h2(gw: H2Gateway) -> None:
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{gw.url}/v1/chat/completions", json=CHAT)
    assert r.http_version == "HTTP/1.1" and r.status_code == 200


def test_h2load_many_streams_few_connections(gw: H2Gateway, tmp_path: Path) -> None:
    h2load = require_binary("h2load")
    body = tmp_path / "body.json"
    body.write_text(json.dumps(CHAT))
    out = subprocess.run(
        [
            h2load,
            "-n",
            "3000",
            "-c",
            "3",
            "-m",
            "50",
            "-d",
            str(body),
            "-H",
            "content-type: application/json",
            f"{gw.url}/v1/chat/completions",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,  # fmt: skip
    ).stdout
    assert "3000 succeeded, 0 failed" in out, out
    assert "3000 2xx" in out, out


def test_auth_401_over_h2(gw: H2Gateway) -> None:
    with client() as c:
        r = c.get(f"{gw.url}/secure/v1/models")
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["error"]["type"]


def test_rate_limit_429_with_retry_after_over_h2(backend: Backend, tmp_path: Path) -> None:
    rule = "rate_limits:\n  rules:\n    - {name: one, key: [], qps: 1}\n"
    g = start_h2_gateway(backend, tmp_path, rule)
    try:
        with client() as c:
            statuses = [c.post(f"{g.url}/v1/chat/completions", json=CHAT) for _ in range(8)]
        assert statuses[0].status_code == 200
        limited = next(r for r in statuses if r.status_code != 200)
        assert limited.status_code == 429, limited.text
        assert int(limited.headers["retry-after"]) >= 1
        assert limited.json()["error"]["type"]
    finally:
        assert g.proc.stop() == 0, g.proc.output()


def test_slow_stream_does_not_stall_its_connection(gw: H2Gateway) -> None:
    """Stream 1 (a token stream) gets no window back from the client; stream 3 on the same
    connection is answered whole meanwhile, and stream 1 is still open, not ended."""
    import socket

    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 300}
    )
    conn.initiate_connection()
    base = [(":scheme", "http"), (":authority", "127.0.0.1"), ("content-type", "application/json")]
    slow = json.dumps({**CHAT, "stream": True, "max_tokens": 200}).encode()
    conn.send_headers(1, [(":method", "POST"), (":path", "/v1/chat/completions"), *base])
    conn.send_data(1, slow, end_stream=True)
    sock.sendall(conn.data_to_send())
    got1, got3, ended = 0, b"", set[int]()

    def receive() -> dict[str, object]:
        """One read from the connection: what stream 1 has had so far, which streams ended."""
        nonlocal got1, got3
        data = sock.recv(65536)
        assert data, "connection closed"
        for e in conn.receive_data(data):
            if isinstance(e, h2.events.DataReceived):
                if e.stream_id == 3:
                    got3 += e.data
                    conn.acknowledge_received_data(e.flow_controlled_length, 3)
                else:
                    got1 += len(e.data)
            elif isinstance(e, h2.events.StreamEnded | h2.events.StreamReset):
                ended.add(e.stream_id)
        sock.sendall(conn.data_to_send())
        return {"stream 1 bytes": got1, "ended": sorted(ended)}

    # The engine splits its writes to the window, so the slow stream stalls at exactly 300.
    wait_until(receive, ok=lambda st: st["stream 1 bytes"] == 300, interval=0,
               what="stream 1's 300-byte window full", ignore=(TimeoutError,))  # fmt: skip
    fast = json.dumps(CHAT).encode()
    conn.send_headers(3, [(":method", "POST"), (":path", "/v1/chat/completions"), *base])
    conn.send_data(3, fast, end_stream=True)
    sock.sendall(conn.data_to_send())
    wait_until(receive, 5, ok=lambda st: 3 in st["ended"], interval=0, ignore=(TimeoutError,),
               what="stream 3 answered whole beside the stalled stream 1")  # fmt: skip
    assert json.loads(got3)["object"] == "chat.completion"
    assert 1 not in ended and got1 == 300
    sock.close()


def test_values_new_in_each_answer_stay_out_of_the_hpack_table(gw: H2Gateway) -> None:
    """The request id, Sluice's overhead and the body's length, new in every answer, are sent
    as literals never indexed: on a connection of many streams the client's HPACK table keeps
    the fields that repeat (content-type, server), not one entry per answer that pushes those
    out."""
    import socket

    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    base = [(":scheme", "http"), (":authority", "127.0.0.1"), ("content-type", "application/json")]
    head = [(":method", "POST"), (":path", "/v1/chat/completions"), *base]
    bodies = [json.dumps({**CHAT, "max_tokens": n}).encode() for n in range(1, 21)]  # 20 lengths
    answers = [exchange(sock, conn, 2 * n + 1, head, b)[0] for n, b in enumerate(bodies)]
    sock.close()
    assert len(answers) == 20 and all(a[":status"] == "200" for a in answers)
    assert len({a["x-request-id"] for a in answers}) == 20
    assert len({a["content-length"] for a in answers}) > 10
    assert all(float(a["x-sluice-overhead-ms"]) >= 0 for a in answers)
    table = {n for n, _ in conn.decoder.header_table.dynamic_entries}
    assert b"content-type" in table  # the table is in use
    assert not table & {b"x-request-id", b"x-sluice-overhead-ms", b"content-length"}


def test_drain_sends_two_goaways_and_finishes_streams(backend: Backend, tmp_path: Path) -> None:
    """SIGTERM while a token stream runs: GOAWAY(2^31-1), then GOAWAY(last stream = 1); the
    stream still ends with [DONE]; the process exits 0."""
    g = start_h2_gateway(backend, tmp_path)
    conn = RawH2(g.port)
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 40}).encode()
    extra = [("content-type", "application/json")]
    conn.send(conn.headers(1, "POST", "/v1/chat/completions", end_stream=False, extra=extra))
    conn.send(frame(DataFrame(1), data=body, flags={"END_STREAM"}))
    frames = conn.frames(8.0)
    first = wait_until(lambda: next(frames, None), interval=0, what="the stream's first DATA frame",
                       ok=lambda f: isinstance(f, DataFrame) and f.stream_id == 1)  # fmt: skip
    assert "END_STREAM" not in first.flags  # it runs: 40 tokens, 20 ms apart
    g.proc.popen.terminate()
    goaways: list[int] = []
    data = first.data
    ended = False
    for f in frames:
        if isinstance(f, GoAwayFrame):
            goaways.append(f.last_stream_id)
        elif isinstance(f, DataFrame) and f.stream_id == 1:
            data += f.data
            ended = ended or "END_STREAM" in f.flags
    conn.close()
    assert g.proc.popen.wait(15) == 0, g.proc.output()
    g.proc.stop()
    assert goaways == [2**31 - 1, 1], goaways
    assert ended and data.rstrip().endswith(b"data: [DONE]")
