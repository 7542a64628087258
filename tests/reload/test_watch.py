"""PolicyWatcher: polls stat, debounces, reloads once per settled change, never dies.

`poll(now)` is driven with a manual time for the exact debounce rules; the asyncio tests run the
real task on a short interval against real files.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.loader import load_policy_text
from gateway.reload.holder import PolicyHolder
from gateway.reload.watch import PolicyWatcher
from tests.reload.test_holder import V1, V2, build, holder_at
from tests.reload.traffic_support import BASE
from tests.support import until

V3 = V1.replace("9000", "9020")


def make(tmp_path: Path) -> tuple[PolicyHolder[CompiledPolicy], Path]:
    return holder_at(tmp_path)


async def test_poll_waits_for_the_signature_to_settle(tmp_path: Path) -> None:
    holder, path = make(tmp_path)
    w = PolicyWatcher(holder, interval_s=1.0, debounce_s=0.3)
    w.start()
    try:
        assert w.poll(10.0) is None  # nothing changed
        path.write_text(V2[:40])  # a partial write...
        assert w.poll(10.1) is None
        path.write_text(V2[:80])  # ...more of it, 0.1 s later: the clock restarts
        assert w.poll(10.2) is None
        path.write_text(V2)
        assert w.poll(10.3) is None
        assert w.poll(10.5) is None  # stable for 0.2 s only
        assert w.poll(10.7) is None  # stable for longer than 0.3 s: first read
        assert w.poll(10.9) is None  # the second read waits a window after the first
        result = w.poll(11.0)  # read again, the same bytes: reload what was read
        assert result is not None and result.ok and result.changed
        assert holder.reloads == 1
        assert w.poll(20.0) is None  # nothing new
        assert holder.reloads == 1
    finally:
        await w.stop()


async def test_poll_failed_reload_is_not_retried_until_the_file_changes(tmp_path: Path) -> None:
    holder, path = make(tmp_path)
    v1 = holder.version
    w = PolicyWatcher(holder, interval_s=1.0, debounce_s=0.0)
    w.start()
    try:
        path.write_text("routes: [oops\n")
        result = w.poll(1.0)
        assert result is not None and not result.ok
        assert result.errors[0].startswith(f"{path}:2:1: yaml:")
        assert holder.version == v1
        for t in (2.0, 3.0, 4.0):
            assert w.poll(t) is None  # no error storm
        assert holder.reloads == 1
        path.unlink()
        assert w.poll(5.0) is None  # a missing file keeps the old policy, quietly
        path.write_text(V2)
        result = w.poll(6.0)
        assert result is not None and result.changed
    finally:
        await w.stop()


async def test_good_change_is_reloaded_after_debounce(tmp_path: Path) -> None:
    holder, path = make(tmp_path)
    v1 = holder.version
    w = PolicyWatcher(holder, interval_s=0.02, debounce_s=0.1)
    w.start()
    try:
        path.write_text(V2)
        await until(lambda: holder.version != v1)
        assert holder.reloads == 1
        assert holder.last_result.ok
    finally:
        await w.stop()


async def test_garbage_is_recorded_and_old_version_stays(tmp_path: Path) -> None:
    holder, path = make(tmp_path)
    v1 = holder.version
    w = PolicyWatcher(holder, interval_s=0.02, debounce_s=0.05)
    w.start()
    try:
        path.write_bytes(b"\x00\x01garbage: [\n")
        await until(lambda: holder.reloads >= 1)
        assert not holder.last_result.ok
        assert holder.last_result.errors[0].startswith(f"{path}:1:1: yaml:")
        assert holder.version == v1
        await asyncio.sleep(0.2)
        assert holder.reloads == 1  # not retried while the file stays the same
    finally:
        await w.stop()


async def test_rapid_partial_writes_cause_one_reload(tmp_path: Path) -> None:
    holder, path = make(tmp_path)
    w = PolicyWatcher(holder, interval_s=0.02, debounce_s=0.3)
    w.start()
    try:
        with path.open("w") as f:  # an editor streaming the file out in chunks
            for i in range(0, len(V3), 20):
                f.write(V3[i : i + 20])
                f.flush()
                await asyncio.sleep(0.04)
        await until(lambda: holder.reloads >= 1)
        await asyncio.sleep(0.4)
        assert holder.reloads == 1
        assert holder.last_result.ok and holder.last_result.changed
    finally:
        await w.stop()


async def test_editor_rename_and_configmap_symlink_swap(tmp_path: Path) -> None:
    # Kubernetes ConfigMap volume layout: policy.yaml -> ..data/policy.yaml, ..data -> ..v1
    (tmp_path / "..v1").mkdir()
    (tmp_path / "..v1" / "policy.yaml").write_text(V1)
    os.symlink("..v1", tmp_path / "..data")
    path = tmp_path / "policy.yaml"
    os.symlink("..data/policy.yaml", path)
    holder = PolicyHolder(path, build)
    w = PolicyWatcher(holder, interval_s=0.02, debounce_s=0.05)
    w.start()
    try:
        v1 = holder.version
        (tmp_path / "..v2").mkdir()
        (tmp_path / "..v2" / "policy.yaml").write_text(V2)
        os.symlink("..v2", tmp_path / "..data_tmp")
        os.rename(tmp_path / "..data_tmp", tmp_path / "..data")  # atomic swap, as kubelet does
        await until(lambda: holder.version != v1)
        v2 = holder.version
        # An editor's write-to-temp-then-rename over the resolved file.
        tmp = tmp_path / "..v2" / ".policy.yaml.swp"
        tmp.write_text(V3)
        os.replace(tmp, tmp_path / "..v2" / "policy.yaml")
        await until(lambda: holder.version != v2)
        assert holder.reloads == 2
    finally:
        await w.stop()


async def test_watcher_survives_a_failing_poll(tmp_path: Path) -> None:
    holder, path = make(tmp_path)
    calls = 0

    class Exploding:
        path = holder.path

        def reload(self, text=None):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            raise RuntimeError("boom")

    w = PolicyWatcher(Exploding(), interval_s=0.02, debounce_s=0.0)
    w.start()
    try:
        path.write_text(V2)
        await until(lambda: calls >= 1)
        path.write_text(V3)
        await until(lambda: calls >= 2)  # still polling after the exception
    finally:
        await w.stop()
    await w.stop()  # idempotent


# --- a slow in-place writer: truncates, then writes the file in pieces, pausing at lines ---
SLOW_FINAL = BASE.replace("9001", "9002") + "  - name: spare\n    match: {path_prefix: /x/}\n"
SLOW_FINAL += "    backend: vllm\n"


async def slow_write(path: Path, text: str, pause: float, every: int) -> None:
    lines = text.splitlines(keepends=True)
    with path.open("w") as f:  # in place: truncated first, like many editors' save
        for i, line in enumerate(lines):
            f.write(line)
            if i % every == every - 1:
                f.flush()
                await asyncio.sleep(pause)  # the pause falls at a line boundary


async def watch_slow_writer(
    tmp_path: Path, final: str, pause: float, debounce: float, guard_traffic: bool = False
) -> tuple[list[str], PolicyHolder[CompiledPolicy]]:
    """Versions the holder swapped in while a slow writer wrote `final` over BASE."""
    from gateway.core.clock import ManualClock
    from tests.reload.traffic_support import book_with, compiled

    path = tmp_path / "policy.yaml"
    path.write_text(BASE)
    holder = PolicyHolder(path, build)
    if guard_traffic:
        holder.traffic = book_with(compiled(BASE), ManualClock(0.0), 100).snapshot
    swaps: list[str] = []
    holder.on_swap(lambda: swaps.append(holder.version))
    w = PolicyWatcher(holder, interval_s=0.02, debounce_s=debounce)
    w.start()
    try:
        await asyncio.sleep(0.05)
        await slow_write(path, final, pause, every=3)
        want = compile_policy(load_policy_text(final, str(path))).version
        await until(lambda: holder.version == want, timeout=10.0)
        await asyncio.sleep(2 * debounce + 0.1)
    finally:
        await w.stop()
    return swaps, holder


async def test_slow_writer_pausing_within_the_window_is_loaded_once(tmp_path: Path) -> None:
    swaps, holder = await watch_slow_writer(tmp_path, SLOW_FINAL, pause=0.1, debounce=0.3)
    assert swaps == [holder.version]  # only the whole file, never a prefix of it


async def test_slow_writer_with_end_marker_is_never_loaded_half_written(tmp_path: Path) -> None:
    final = "end_marker: '# end of policy'\n" + SLOW_FINAL + "# end of policy\n"
    swaps, holder = await watch_slow_writer(tmp_path, final, pause=0.3, debounce=0.05)
    assert swaps == [holder.version]
    assert holder.reloads > 1  # it did look at the half-written states, and refused them
    assert "end marker" in "\n".join(holder.last_errors)


async def test_slow_writer_half_file_losing_routes_is_held_by_the_guard(tmp_path: Path) -> None:
    swaps, holder = await watch_slow_writer(
        tmp_path, SLOW_FINAL, pause=0.3, debounce=0.05, guard_traffic=True
    )
    assert swaps == [holder.version]
    assert any(e["event"] == "held" for e in holder.events), list(holder.events)


async def test_control_a_long_pause_without_protection_loads_a_prefix(tmp_path: Path) -> None:
    # Why the marker and the guard exist: the watcher alone cannot tell a long pause from the end.
    swaps, holder = await watch_slow_writer(tmp_path, SLOW_FINAL, pause=0.3, debounce=0.05)
    assert len(swaps) > 1 and swaps[-1] == holder.version
