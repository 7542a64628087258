"""Policy changes that cannot cause an outage, on a real gateway under live traffic: the change
guard holds each outage-shaped change (no request fails) until forced; a staged rollout of a
failing change is rolled back at its first percentage stage while the old policy serves; a good
one reaches 100 %; requests finish on the version they started with; the CLI prints the same
findings."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.policy.compiled import compile_policy
from gateway.policy.loader import load_policy_text
from tests.integration.conftest import Backend, Gateway, http_json, policy_yaml, start_gateway
from tests.support import ROOT, Proc, free_port, until, wait_for_port

pytestmark = pytest.mark.integration

CHAT = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hello there"}]}


def version_of(text: str) -> str:
    return compile_policy(load_policy_text(text, "p")).version


def start_backend(tmp: Path, *extra: str) -> Backend:
    http, grpc, admin = free_port(), free_port(), free_port()
    args = ["mock-backend", "--http", f"127.0.0.1:{http}", "--grpc", f"127.0.0.1:{grpc}"]
    args += ["--admin", f"127.0.0.1:{admin}"]
    proc = Proc([*args, "--ttft-ms", "5", "--token-delay-ms", "1", *extra], tmp / f"b{http}.log")
    wait_for_port(http)
    wait_for_port(grpc)
    return Backend(proc, http, grpc, admin)


@pytest.fixture(scope="module")
def quick(backend: Backend) -> Backend:
    backend.knobs(ttft_ms=5, token_delay_ms=1)  # this module's own backend process
    return backend


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """A second backend: the target of the new policies (failing or not, by its knobs)."""
    b = start_backend(tmp_path_factory.mktemp("other"))
    try:
        yield b
    finally:
        b.proc.stop()


@dataclass
class Load:
    """Clients sending chat completions until stopped; every (start time, status) is kept."""

    url: str
    concurrency: int = 6
    statuses: list[tuple[float, int]] = field(default_factory=list)
    _stop: bool = False
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def __aenter__(self) -> Load:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        self._tasks = [asyncio.ensure_future(self._client(i)) for i in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)
        await self._session.close()

    async def _client(self, k: int) -> None:
        n = 0
        while not self._stop:
            n += 1
            headers = {"x-request-id": f"c{k}-{n}-{time.monotonic_ns()}"}
            started = time.monotonic()
            try:
                async with self._session.post(self.url, json=CHAT, headers=headers) as r:
                    await r.read()
                    self.statuses.append((started, r.status))
            except aiohttp.ClientError:
                self.statuses.append((started, -1))

    def since(self, t: float) -> Counter[int]:
        """Statuses of the requests that started at `t` or later."""
        return Counter(s for at, s in self.statuses if at >= t)

    async def wait_requests(self, n: int, timeout: float = 20.0) -> None:
        start = len(self.statuses)
        await until(lambda: self.statuses[start:], timeout, ok=lambda new: len(new) >= n,
                    what=f"{n} more answers from the load")  # fmt: skip


def policy_status(gw: Gateway) -> dict[str, Any]:
    return http_json(f"{gw.admin}/admin/policy")["status"]  # type: ignore[no-any-return]


def post(url: str) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def good_text(b: Backend, gw: Gateway, **extra: str) -> str:
    return policy_yaml(b, gw.http_port, gw.grpc_port, gw.admin_port, **extra)


# --- the change guard ------------------------------------------------------------------------
def guarded(b: Backend, gw: Gateway) -> dict[str, tuple[str, int, str]]:
    """Each change of the issue -> (policy text, what a request gets once forced, finding)."""
    good = good_text(b, gw)
    http_ep = f'endpoints: [{{address: "127.0.0.1:{b.http_port}"}}]'
    return {
        "all-weights-0": (
            good.replace(http_ep, http_ep.replace('"}]', '", weight: 0}]')),
            503,
            "no_endpoint",
        ),
        "routes-empty": (good[: good.index("routes:")] + "routes: []\n", 404, "no_route"),
        "first-byte": (
            good_text(b, gw, timeouts="first_byte_s: 0.000001\n  drain_s: 10"),
            504,
            "first_byte_timeout",
        ),
        "max-body-1": (
            good.replace("max_body_bytes: 1048576", "max_body_bytes: 1"),
            413,
            "body_too_large",
        ),
    }


async def test_each_guarded_change_is_held_under_traffic_then_forced(
    quick: Backend, tmp_path: Path
) -> None:
    gw = start_gateway(quick, tmp_path)
    try:
        good = good_text(quick, gw)
        good_version = version_of(good)
        async with Load(f"{gw.http}/v1/chat/completions") as load:
            await load.wait_requests(40)
            for name, (text, forced_status, kind) in guarded(quick, gw).items():
                bad_version = version_of(text)
                t0 = time.monotonic()
                gw.policy.write_text(text)  # the file watcher picks it up
                held = await until(
                    lambda v=bad_version: (policy_status(gw)["held"] or {}).get("version") == v,
                    15,
                    what=f"{name} held",
                )
                st = policy_status(gw)
                assert held and st["version"] == good_version, name
                findings = st["held"]["guard"]["findings"]
                assert findings[0]["kind"] == kind and findings[0]["route"] == "openai", findings
                assert findings[0]["share"] >= 0.5
                await load.wait_requests(30)  # traffic goes on, on the running policy
                seen = load.since(t0)
                assert set(seen) == {200}, (name, seen)  # not one request failed
                # The CLI prints the same findings before anyone ships.
                out = sluice("policy", "check", str(gw.policy), "--against", gw.admin)
                assert out.returncode == 2, out.stdout + out.stderr
                assert "guard: HELD:" in out.stdout and f"{kind}: " in out.stdout, out.stdout
                # Forced, it applies, and does what it says.
                code, st = post(f"{gw.admin}/admin/policy/reload?force=1")
                assert code == 200 and st["version"] == bad_version, (name, code, st)
                t1 = time.monotonic()
                await load.wait_requests(10)
                assert forced_status in load.since(t1), (name, load.since(t1))
                # Back to the good file: nothing the running (broken) policy serves is lost.
                gw.policy.write_text(good)
                await until(
                    lambda: policy_status(gw)["version"] == good_version,
                    15,
                    what=f"{name} restored",
                )
                t2 = time.monotonic()
                await load.wait_requests(10)
                assert set(load.since(t2)) == {200}, (name, load.since(t2))
        with urllib.request.urlopen(f"{gw.admin}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'sluice_policy_reloads_total{result="held"}' in text
        assert "sluice_policy_held 0.0" in text
        assert "HELD" in gw.proc.output()
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


# --- staged rollouts -------------------------------------------------------------------------
def rollout_text(b: Backend, gw: Gateway, target: Backend, tail: str, route: str = "v2") -> str:
    """The good policy, its HTTP route sent to `target`, plus `tail` (a rollout section)."""
    text = good_text(b, gw, http_route_name=route, tail=tail)
    return text.replace(
        f'endpoints: [{{address: "127.0.0.1:{b.http_port}"}}]',
        f'endpoints: [{{address: "127.0.0.1:{target.http_port}"}}]',
    )


@pytest.fixture(scope="module")
def rgw(quick: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # Its tests reload explicitly (the admin API, the CLI's apply): a file watcher would race
    # them, and on a loaded machine load a file before `sluice policy apply` has started.
    gw = start_gateway(
        quick, tmp_path_factory.mktemp("rollout"), env={"SLUICE_WATCH_INTERVAL": "3600"}
    )
    try:
        yield gw
    finally:
        assert gw.proc.stop() == 0, gw.proc.output()


def restore(gw: Gateway, b: Backend) -> None:
    good = good_text(b, gw)
    gw.policy.write_text(good)
    code, st = post(f"{gw.admin}/admin/policy/reload?rollout=none")
    assert code == 200 and st["version"] == version_of(good), st
    assert st["rollout"] is None or st["rollout"]["phase"] in ("rolled_back", "aborted", "complete")


async def test_failing_rollout_is_rolled_back_at_its_first_stage(
    rgw: Gateway, quick: Backend, other: Backend
) -> None:
    other.knobs(failure="http_5xx")
    try:
        old_version = policy_status(rgw)["version"]
        tail = "rollout: {stages: [shadow, 10, 50, 100], hold_s: 0.5, min_requests: 20}\n"
        text = rollout_text(quick, rgw, other, tail)
        async with Load(f"{rgw.http}/v1/chat/completions", concurrency=8) as load:
            await load.wait_requests(40)
            rgw.policy.write_text(text)
            code, st = post(f"{rgw.admin}/admin/policy/reload")
            assert code == 202 and st["rollout"]["phase"] == "shadow", (code, st)
            versions = set()

            def stopped() -> Any:
                s = policy_status(rgw)
                versions.add(s["version"])
                ro = s["rollout"]
                return ro if ro and ro["phase"] not in ("shadow", "serving") else None

            ro = await until(stopped, timeout=30, what="rollback")
            await load.wait_requests(20)
        assert versions == {old_version}  # the old policy served all along
        assert ro["phase"] == "rolled_back" and ro["stage"] == "10%", ro
        assert [h["stage"] for h in ro["history"]] == ["shadow", "10%"]
        assert ro["history"][0]["event"] == "passed"
        failed = sum(1 for _, s in load.statuses if s >= 500)
        served_new = ro["stopped"]["new_requests_served"]
        # Every request the new policy got failed; every other one was served by the old.
        assert failed == served_new > 0, (failed, ro)
        assert all(s in (200, 500) for _, s in load.statuses), Counter(load.statuses)
        print(
            f"\nrolled back at {ro['stage']} after {served_new} requests on the new policy, "
            f"{ro['stopped']['seconds_since_first_serving_stage']:.2f}s after the 10% stage "
            f"began; {len(load.statuses)} requests in all"
        )
        # The same version again is held: no bounce.
        code, st = post(f"{rgw.admin}/admin/policy/reload")
        assert code == 409 and "rolled back" in st["held"]["reason"], st
        out = sluice("policy", "rollout", "status", "--admin", rgw.admin)
        assert out.returncode == 0 and "rolled_back" in out.stdout, out.stdout + out.stderr
        assert "ROLLED BACK at stage 10%" in rgw.proc.output()
    finally:
        other.knobs(failure="none")
        restore(rgw, quick)


async def test_good_rollout_reaches_100_percent(
    rgw: Gateway, quick: Backend, other: Backend
) -> None:
    tail = "rollout: {stages: [shadow, 20, 100], hold_s: 0.4, min_requests: 10}\n"
    text = rollout_text(quick, rgw, other, tail, route="v3")
    new_version = version_of(text)
    try:
        async with Load(f"{rgw.http}/v1/chat/completions") as load:
            await load.wait_requests(30)
            rgw.policy.write_text(text)
            code, _ = post(f"{rgw.admin}/admin/policy/reload")
            assert code == 202
            await until(
                lambda: policy_status(rgw)["version"] == new_version, timeout=30, what="100 %"
            )
            await load.wait_requests(10)
        ro = policy_status(rgw)["rollout"]
        assert ro["phase"] == "complete", ro
        assert [h["stage"] for h in ro["history"]] == ["shadow", "20%", "100%"]
        assert set(s for _, s in load.statuses) == {200}
    finally:
        restore(rgw, quick)


async def _stream(s: aiohttp.ClientSession, url: str, rid: str, tokens: int) -> int:
    body = {"model": "m", "stream": True, "max_tokens": tokens, "prompt": "x"}
    async with s.post(url, json=body, headers={"x-request-id": rid}) as r:
        assert r.status == 200
        lines = [line.strip() async for line in r.content if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return sum(1 for line in lines if b'"finish_reason":null' in line)


def served_ids(b: Backend) -> set[str]:
    return {s["request_id"] or "" for s in b.stats()["seen"]}  # request ids, never values


async def test_requests_finish_on_the_version_they_started_with(
    rgw: Gateway, quick: Backend, other: Backend
) -> None:
    tokens = 40  # 40 x 25 ms: a second per stream
    quick.knobs(token_delay_ms=25, completion_tokens=tokens)
    other.knobs(token_delay_ms=25, completion_tokens=tokens)
    url = f"{rgw.http}/v1/completions"
    # Stages that never advance by themselves: the test moves them.
    tail = "rollout: {stages: [50, 100], hold_s: 600, min_requests: 100000}\n"
    try:
        async with aiohttp.ClientSession() as s:
            for ending in ("abort", "promote"):
                quick.reset()
                other.reset()
                text = rollout_text(quick, rgw, other, tail, route=f"sticky-{ending}")
                rgw.policy.write_text(text)
                code, _ = post(f"{rgw.admin}/admin/policy/reload")
                assert code == 202
                rids = [f"{ending}-{i}" for i in range(12)]
                streams = [asyncio.ensure_future(_stream(s, url, r, tokens)) for r in rids]
                await until(
                    lambda want=set(rids): (served_ids(other) | served_ids(quick)) & want,  # type: ignore[misc]
                    ok=lambda ids: len(ids) == 12,
                    what="every stream at a backend, on one side or the other",
                )
                on_new = served_ids(other) & set(rids)
                on_old = served_ids(quick) & set(rids)
                assert on_new and on_old and not on_new & on_old, (on_new, on_old)
                code, st = post(f"{rgw.admin}/admin/policy/rollout/{ending}")
                assert code == 200
                assert not any(t.done() for t in streams)  # all mid-stream at the switch
                if ending == "promote":
                    assert st["stage"] == "100%"
                    code, st = post(f"{rgw.admin}/admin/policy/rollout/promote")
                    assert code == 200 and st["phase"] == "complete"
                else:
                    assert st["phase"] == "aborted"
                counts = await asyncio.gather(*streams)
                assert counts == [tokens] * len(rids)  # none cut, none moved
                assert served_ids(other) & set(rids) == on_new
                assert served_ids(quick) & set(rids) == on_old
                restore(rgw, quick)
    finally:
        quick.knobs(token_delay_ms=1, completion_tokens=16)
        other.knobs(token_delay_ms=1, completion_tokens=16)
        restore(rgw, quick)


async def test_cli_apply_diff_and_rollout(rgw: Gateway, quick: Backend, other: Backend) -> None:
    async with Load(f"{rgw.http}/v1/chat/completions", concurrency=2) as load:
        await load.wait_requests(30)
    good = good_text(quick, rgw)
    broken = good[: good.index("routes:")] + "routes: []\n"
    candidate = rgw.policy.with_name("candidate.yaml")
    candidate.write_text(broken)
    out = sluice("policy", "diff", str(candidate), "--against", rgw.admin)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "- routes[name=openai]" in out.stdout and "guard: HELD:" in out.stdout
    assert "no_route: " in out.stdout
    # `apply` reloads the served file: held, then forced, then back.
    rgw.policy.write_text(broken)
    out = sluice("policy", "apply", "--admin", rgw.admin)
    assert out.returncode == 2 and "held: version" in out.stdout, out.stdout + out.stderr
    out = sluice("policy", "apply", "--admin", rgw.admin, "--force")
    assert out.returncode == 0 and f"serving version {version_of(broken)}" in out.stdout
    rgw.policy.write_text(good)
    out = sluice("policy", "apply", "--admin", rgw.admin, "--rollout", "shadow,50,100")
    assert out.returncode == 0 and "rollout " in out.stdout and "shadow" in out.stdout, out.stdout
    out = sluice("policy", "rollout", "abort", "--admin", rgw.admin)
    assert out.returncode == 0 and "aborted" in out.stdout
    out = sluice("policy", "rollout", "promote", "--admin", rgw.admin)
    assert out.returncode == 1 and "no rollout in progress" in out.stdout
    restore(rgw, quick)
