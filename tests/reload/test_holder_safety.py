"""PolicyHolder with the change guard and staged rollouts, driven by hand: a manual clock and
requests recorded as the gateway's `snapshot_for` / `finish` would."""

from __future__ import annotations

import time
from pathlib import Path

from gateway.core.clock import ManualClock
from gateway.core.request import RequestInfo, Wire
from gateway.policy.compiled import CompiledPolicy
from gateway.policy.model import Rollout
from gateway.reload.holder import PolicyHolder
from gateway.telemetry import metrics
from tests.reload.test_guard import NO_ROUTES
from tests.reload.traffic_support import BASE, add, book_with, served

FAST = "rollout: {stages: [shadow, 10, 50, 100], hold_s: 1, min_requests: 20}\n"
MOVED = BASE.replace("9001", "9002")  # a harmless change


def make(
    tmp_path: Path, text: str = BASE
) -> tuple[PolicyHolder[CompiledPolicy], Path, ManualClock]:
    clock = ManualClock(100.0)
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    holder: PolicyHolder[CompiledPolicy] = PolicyHolder(path, lambda c: c, clock.now)
    return holder, path, clock


def drive(
    holder: PolicyHolder[CompiledPolicy], clock: ManualClock, n: int, new_fails: bool
) -> dict[str, int]:
    """`n` requests at 100/s; the new policy's answer 502 when `new_fails`. Returns the count
    each side served (by version)."""
    served_by: dict[str, int] = {}
    for i in range(n):
        ro = holder.rollout
        info = RequestInfo(Wire.HTTP, "POST", "/v1/chat/completions", {"x-request-id": f"req-{i}"})
        snap = holder.active if ro is None else ro.choose(info)
        bad = new_fails and ro is not None and snap is ro.candidate
        ctx = served(snap, status=502 if bad else 200, started=time.monotonic() - 0.02)
        served_by[snap.version] = served_by.get(snap.version, 0) + 1
        if ro is not None:
            ro.record(snap, ctx)
        clock.t += 0.01
        if i % 10 == 0:
            holder.tick()
    return served_by


def test_a_failing_change_is_rolled_back_at_its_first_percentage_stage(tmp_path: Path) -> None:
    holder, path, clock = make(tmp_path)
    old = holder.version
    swaps: list[str] = []
    holder.on_swap(lambda: swaps.append(holder.version))
    before = (
        metrics.REGISTRY.get_sample_value("sluice_policy_rollouts_total", {"result": "rolled_back"})
        or 0.0
    )
    path.write_text(MOVED + FAST)
    result = holder.reload()
    assert result.ok and result.rollout and not result.changed
    assert holder.version == old and holder.rollout is not None
    new = holder.rollout.to_version
    counts = drive(holder, clock, 600, new_fails=True)
    assert holder.rollout is None
    assert holder.version == old and holder.active.version == old  # served all along
    st = holder.rollout_status()
    assert st is not None
    assert st["phase"] == "rolled_back" and st["stage"] == "10%"
    assert [h["stage"] for h in st["history"]] == ["shadow", "10%"]
    assert st["history"][0]["event"] == "passed"
    assert "error rate of the new policy 100.0%" in st["stopped"]["reason"]
    served_new = st["stopped"]["new_requests_served"]
    assert served_new == counts[new]
    # Called as soon as the breach is certain (1 failure in 20 is 5 % > the old side's 0 % +
    # 2 %), at the next tick: a handful of requests, not min_requests.
    assert 1 <= served_new < 10
    assert swaps == [old]  # subscribers learn that the candidate is gone
    assert [e["event"] for e in holder.events][-3:] == ["rollout_started", "stage", "rolled_back"]
    assert (
        metrics.REGISTRY.get_sample_value("sluice_policy_rollouts_total", {"result": "rolled_back"})
        == before + 1
    )
    assert metrics.REGISTRY.get_sample_value("sluice_policy_rollout_percent") == -1
    # The same version again is held (no bounce), until forced.
    again = holder.reload()
    assert again.held and "rolled back" in str(holder.held)
    forced = holder.reload(force=True)
    assert forced.rollout and holder.rollout is not None and holder.rollout.to_version == new


def test_a_good_change_reaches_100_percent(tmp_path: Path) -> None:
    holder, path, clock = make(tmp_path)
    old = holder.version
    path.write_text(MOVED + FAST)
    assert holder.reload().rollout
    assert holder.rollout is not None
    new = holder.rollout.to_version
    stages_seen = set()
    for _ in range(20):
        if holder.rollout is None:
            break
        stages_seen.add(holder.rollout.stage)
        drive(holder, clock, 100, new_fails=False)
    assert holder.rollout is None and holder.version == new != old
    assert stages_seen == {"shadow", "10%", "50%", "100%"}
    st = holder.rollout_status()
    assert st is not None and st["phase"] == "complete"
    assert [h["event"] for h in st["history"]] == ["passed"] * 4


def test_one_request_id_sees_one_version_and_stays_on_new(tmp_path: Path) -> None:
    holder, path, clock = make(tmp_path)
    path.write_text(MOVED)
    holder.reload(rollout=Rollout(stages=[10, 50, 100], hold_s=1, min_requests=1))
    ro = holder.rollout
    assert ro is not None
    infos = [
        RequestInfo(Wire.HTTP, "GET", "/v1/models", {"x-request-id": f"id-{i}"})
        for i in range(2000)
    ]
    first = [ro.choose(i) is ro.candidate for i in infos]
    assert [ro.choose(i) is ro.candidate for i in infos] == first  # stable per id
    assert 150 < sum(first) < 250  # ~10 %
    holder.promote()
    assert ro.stage == "50%"
    second = [ro.choose(i) is ro.candidate for i in infos]
    assert all(b for a, b in zip(first, second, strict=True) if a)  # never back to old
    assert 900 < sum(second) < 1100
    # Without an id, a counter spreads requests over the share evenly.
    anon = RequestInfo(Wire.HTTP, "GET", "/v1/models")
    assert sum(ro.choose(anon) is ro.candidate for _ in range(10_000)) == 5000


def test_abort_supersede_and_revert(tmp_path: Path) -> None:
    holder, path, clock = make(tmp_path)
    old = holder.version
    path.write_text(MOVED + FAST)
    holder.reload()
    st = holder.abort()
    assert st is not None and st["phase"] == "aborted" and holder.rollout is None
    assert holder.version == old
    # A second change during a rollout replaces it; the file going back ends it.
    holder.reload()
    first = holder.rollout
    path.write_text(BASE.replace("9001", "9003") + FAST)
    holder.reload()
    assert holder.rollout is not None and holder.rollout is not first
    assert first is not None and first.state.phase.value == "aborted"
    path.write_text(BASE)
    result = holder.reload()
    assert result.ok and not result.changed and holder.rollout is None
    assert holder.version == old
    # Promote all the way by hand.
    path.write_text(MOVED + FAST)
    holder.reload()
    for _ in range(4):
        holder.promote()
    assert holder.rollout is None and holder.version != old
    assert holder.promote() is None and holder.abort() is None


def test_guard_holds_then_force_applies(tmp_path: Path) -> None:
    holder, path, clock = make(tmp_path)
    book = book_with(holder.compiled, clock, 50)
    add(book, holder.compiled, clock, 10, path="/pkg.Svc/Call", protocol=Wire.GRPC)
    holder.traffic = book.snapshot
    old = holder.version
    path.write_text(NO_ROUTES)
    result = holder.reload()
    assert result.ok and result.held and not result.changed and holder.version == old
    assert result.guard is not None and result.guard.share == 1.0
    st = holder.status()
    assert st["held"]["guard"]["findings"][0]["kind"] == "no_route"  # type: ignore[index]
    assert st["last_reload"]["held"] is True  # type: ignore[index]
    assert metrics.REGISTRY.get_sample_value("sluice_policy_held") == 1
    assert metrics.REGISTRY.get_sample_value("sluice_policy_guard_affected_share") == 1.0
    assert metrics.REGISTRY.get_sample_value("sluice_policy_last_reload_success") == 0
    forced = holder.reload(force=True)
    assert forced.changed and holder.version != old
    assert metrics.REGISTRY.get_sample_value("sluice_policy_held") == 0
    assert holder.status()["held"] is None


def test_force_true_in_the_file(tmp_path: Path) -> None:
    holder, path, clock = make(tmp_path)
    holder.traffic = book_with(holder.compiled, clock, 50).snapshot
    path.write_text(NO_ROUTES + "force: true\n")
    assert holder.reload().changed


def test_shadow_stage_catches_a_bad_route_change_before_any_request_is_served(
    tmp_path: Path,
) -> None:
    holder, path, clock = make(tmp_path)
    old = holder.version
    # /v1/ requests would find no route (the guard would hold it; here it has no traffic).
    path.write_text(BASE.replace("path_prefix: /v1/", "path_prefix: /v2/") + FAST)
    assert holder.reload().rollout
    drive(holder, clock, 100, new_fails=False)
    st = holder.rollout_status()
    assert st is not None and st["phase"] == "rolled_back" and st["stage"] == "shadow", st
    assert st["stopped"]["new_requests_served"] == 0
    shadow = st["history"][0]["shadow"]
    assert shadow["changes"][0] == {"old": "route:openai", "new": "no_route", "requests": 1}
    assert holder.version == old


def test_filters_can_take_part_in_the_shadow_stage(tmp_path: Path) -> None:
    from gateway.context import RequestContext, Status
    from gateway.core.verdict import reject

    holder, path, clock = make(tmp_path)
    calls: list[str] = []

    def deny_all(ctx: RequestContext) -> Status:  # decides, takes nothing: no side effect
        calls.append(ctx.policy.version)
        return ctx.stop(reject(401, 16, "unauthenticated", "no token"))

    old = holder.version
    holder.shadow_hooks = lambda snap: [deny_all] if snap.version != old else []
    path.write_text(MOVED + FAST)
    holder.reload()
    drive(holder, clock, 50, new_fails=False)
    st = holder.rollout_status()
    assert st is not None and st["phase"] == "rolled_back" and st["stage"] == "shadow"
    assert st["history"][0]["shadow"]["changes"][0]["new"] == "unauthenticated"
    assert calls and set(calls) == {st["to_version"]}  # only the new policy's hook ran


def test_the_status_section_says_what_needs_attention(tmp_path: Path) -> None:
    from gateway.reload.staging import RolloutView

    holder, path, clock = make(tmp_path)
    view = RolloutView(holder)
    assert view.state() == {"colour": "green", "version": holder.version, "stage": "",
                            "candidate": ""}  # fmt: skip
    path.write_text(MOVED + FAST)
    holder.reload()
    st = view.state()
    assert st["stage"] == "shadow" and st["candidate"] and st["colour"] == "green"
    drive(holder, clock, 300, new_fails=True)
    st = view.state()
    assert st["colour"] == "yellow" and "rolled_back at 10%" in st["last"]
    path.write_text(BASE)  # the file is put back: nothing left to look at
    holder.reload()
    assert view.state()["colour"] == "green"
