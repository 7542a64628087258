"""The `sluice policy` commands that talk to a running gateway's admin API: `check --against`,
`diff --against`, `apply`, `rollout status|promote|abort`.

Plain urllib with a timeout on every call (the admin API is loopback HTTP); every failure is an
`AdminError` with a message a human can act on. With `--workers N` each request reaches one
worker (the admin port is shared); send SIGHUP to reload them all.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gateway.errors import AdminError
from gateway.policy.compiled import CompiledPolicy, compile_policy
from gateway.policy.model import Policy
from gateway.reload.guard import GuardReport, check_change
from gateway.reload.traffic import TrafficSnapshot

DEFAULT_ADMIN = "http://127.0.0.1:9901"
TIMEOUT_S = 10.0
MAX_RESPONSE = 16 * 1024 * 1024


def call(base: str, path: str, method: str = "GET") -> tuple[int, Any]:
    """(HTTP status, parsed JSON) of one admin request; 4xx answers are returned, not raised."""
    url = base.rstrip("/") + path
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, json.loads(r.read(MAX_RESPONSE))
    except urllib.error.HTTPError as e:
        with e:
            body = e.read(MAX_RESPONSE)
        try:
            return e.code, json.loads(body)
        except ValueError:
            raise AdminError(f"{url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise AdminError(f"{url}: cannot reach the admin API: {reason}") from None


def running(base: str) -> tuple[CompiledPolicy, TrafficSnapshot]:
    """The policy a gateway serves now and its recent traffic."""
    code, doc = call(base, "/admin/policy")
    if code != 200:
        raise AdminError(f"{base}/admin/policy: HTTP {code}")
    code, traffic = call(base, "/admin/policy/traffic")
    if code != 200:
        raise AdminError(f"{base}/admin/policy/traffic: HTTP {code}: {traffic}")
    try:
        policy = Policy.model_validate(doc["policy"])
        snap = TrafficSnapshot.from_json(traffic)
    except (KeyError, TypeError, ValueError) as e:
        raise AdminError(f"{base}: unexpected answer: {e}") from None
    return compile_policy(policy), snap


def guard_against(base: str, new: Policy, old: Policy | None = None) -> GuardReport:
    """The guard's report for `new` replacing `old` (default: what `base` serves), judged on
    the traffic `base` saw: what the gateway itself would report for that reload."""
    serving, traffic = running(base)
    before = compile_policy(old) if old is not None else serving
    return check_change(before, compile_policy(new), traffic, new.guard)


def reload_query(force: bool, rollout: str | None, hold_s: float | None) -> str:
    q: dict[str, str] = {}
    if force:
        q["force"] = "1"
    if rollout is not None:
        q["rollout"] = rollout
    if hold_s is not None:
        q["hold_s"] = f"{hold_s:g}"
    return "?" + urllib.parse.urlencode(q) if q else ""


def _side(d: dict[str, Any]) -> str:
    p95 = d.get("p95_s")
    return (
        f"{d['requests']} requests, {100 * d['error_rate']:.1f}% errors, "
        f"p95 {'-' if p95 is None else f'{p95:.3f}s'}"
    )


def rollout_lines(st: dict[str, Any] | None) -> list[str]:
    """A rollout status (from /admin/policy/rollout) for a terminal."""
    if not st:
        return ["no rollout"]
    head = (
        f"rollout {st['from_version']} -> {st['to_version']}: {st['phase']}, stage "
        f"{st['stage']} ({', '.join(st['stages'])}), {st['stage_elapsed_s']:.1f}s of "
        f"{st['hold_s']:g}s; requests new {st['requests']['new']}, old {st['requests']['old']}"
    )
    out = [head]
    cmp = st.get("comparison") or {}
    if "new" in cmp:
        out.append(f"  new: {_side(cmp['new'])} | old: {_side(cmp['old'])}")
    if "shadow" in cmp:
        s = cmp["shadow"]
        out.append(
            f"  shadow: {s['requests']} requests, {s['changed']} decided differently, "
            f"{s['new_rejects']} refused by new vs {s['old_rejects']} by old"
        )
    if st.get("waiting"):
        out.append(f"  waiting: {st['waiting']}")
    for h in st.get("history", []):
        out.append(f"  {h['stage']}: {h['event']} after {h['seconds']:.1f}s: {h['reason']}")
    stopped = st.get("stopped")
    if stopped:
        since = stopped.get("seconds_since_first_serving_stage")
        out.append(
            f"  stopped: {stopped['reason']}; the new policy served "
            f"{stopped['new_requests_served']} requests"
            + (f", {since:.2f}s after its first serving stage began" if since is not None else "")
        )
    return out
