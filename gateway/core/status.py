"""(compiled) The gateway's colour: what the status page shows first, decided from the state
document.

Pure: the caller passes the assembled `/admin/state` document (see `gateway.status`), values
come back. Colours are `green`, `yellow`, `red` (and `grey`: off or unknown, ranked as green);
an unknown colour string ranks as yellow, so a feature that invents a new colour is noticed
rather than hidden.

Rules, each giving a colour and a reason (reasons come back worst first):
- a section (any top-level dict) with a `colour` field: that colour ("limits: red");
- a backend member that is unhealthy, ejected, or whose breaker is open: red for the member
  (flat fields `healthy`, `ejected`, `breaker: "open"`, or the snapshots `health: {healthy}`,
  `outlier: {ejected_for_s}`, `breaker: {state}`); half-open: yellow; a gRPC member whose
  channel is in TRANSIENT_FAILURE counts as unhealthy;
- a backend: red when no member is usable, yellow when some are not or when it had upstream
  errors in the recent window;
- the gateway starting or draining, a rejected policy reload, a datapath that should be
  attached and is not: yellow.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

GREEN, YELLOW, RED, GREY = "green", "yellow", "red", "grey"
RANK: Final = {GREY: 0, GREEN: 0, YELLOW: 1, RED: 2}
UNUSABLE_CHANNEL: Final = "TRANSIENT_FAILURE"


def rank(colour: object) -> int:
    return RANK.get(str(colour), 1)


def worst(colours: Iterable[object], default: str = GREEN) -> str:
    best = default
    for c in colours:
        if c is not None and rank(c) > rank(best):
            best = str(c)
    return best


def _nested(m: Mapping[str, Any], key: str, field: str) -> Any:
    v = m.get(key)
    return v.get(field) if isinstance(v, Mapping) else v


def healthy(m: Mapping[str, Any]) -> bool | None:
    """`healthy`, or `health: {healthy}` (a health checker's snapshot); None when unknown."""
    h = m.get("healthy")
    return _nested(m, "health", "healthy") if h is None else bool(h)


def breaker_state(m: Mapping[str, Any]) -> str:
    """`breaker: "open"`, or `breaker: {state: "open"}` (a breaker's snapshot)."""
    return str(_nested(m, "breaker", "state") or "").lower()


def ejected(m: Mapping[str, Any]) -> bool:
    """`ejected: true`, or `outlier: {ejected: true}` / `{ejected_for_s: N}` (an outlier
    detector's snapshot)."""
    if m.get("ejected"):
        return True
    out = m.get("outlier")
    return isinstance(out, Mapping) and bool(out.get("ejected") or out.get("ejected_for_s"))


def member_usable(m: Mapping[str, Any]) -> bool:
    """False when a member's health, ejection, breaker or channel says it takes no traffic."""
    if healthy(m) is False or ejected(m) or breaker_state(m) == "open":
        return False
    return m.get("channel") != UNUSABLE_CHANNEL


def member_colour(m: Mapping[str, Any]) -> str:
    derived = RED if not member_usable(m) else GREEN
    if breaker_state(m) in ("half_open", "half-open"):
        derived = worst([derived, YELLOW])
    return worst([m.get("colour"), derived])


def backend_colour(b: Mapping[str, Any]) -> tuple[str, list[str]]:
    """(colour, reasons) of one backend from its members and its recent upstream errors."""
    name = b.get("name", "?")
    members = [m for m in b.get("members", ()) if isinstance(m, Mapping)]
    down = [str(m.get("address", "?")) for m in members if not member_usable(m)]
    colours: list[object] = [b.get("colour")]
    reasons = []
    if members and len(down) == len(members):
        colours.append(RED)
        reasons.append(f"backend {name}: no usable member ({', '.join(down)} down)")
    elif down:
        colours.append(YELLOW)
        reasons.append(f"backend {name}: {len(down)} of {len(members)} members down")
    errors = b.get("recent_errors", 0)
    if isinstance(errors, int | float) and errors > 0:
        colours.append(YELLOW)
        reasons.append(f"backend {name}: {errors:g} upstream errors recently")
    colour = worst(colours)
    if rank(colour) > 0 and not reasons:
        reasons.append(f"backend {name}: {colour}")
    return colour, reasons


def rollup(doc: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The gateway's colour and the reasons for it, worst first."""
    found: list[tuple[str, str]] = []
    gw = doc.get("gateway", {})
    state = gw.get("state") if isinstance(gw, Mapping) else None
    if state in ("starting", "draining"):
        found.append((YELLOW, f"gateway {state}"))
    policy = doc.get("policy", {})
    last = policy.get("last_reload", {}) if isinstance(policy, Mapping) else {}
    if isinstance(last, Mapping) and last.get("ok") is False:
        found.append((YELLOW, f"policy reload rejected; {policy.get('version')} keeps serving"))
    dp = doc.get("datapath", {})
    if isinstance(dp, Mapping) and dp.get("state") == "unavailable":
        found.append((YELLOW, f"datapath unavailable: {dp.get('error') or 'not attached'}"))
    backends = doc.get("backends", {})
    rows = backends.get("backends", ()) if isinstance(backends, Mapping) else ()
    for b in rows:
        if isinstance(b, Mapping):
            colour, why = backend_colour(b)
            found += [(colour, r) for r in why]
    for key, section in doc.items():
        own = section.get("colour") if isinstance(section, Mapping) else None
        if key != "backends" and own is not None and rank(own) > 0:
            found.append((str(own), f"{key}: {own}"))
    found.sort(key=lambda x: -rank(x[0]))
    return worst(c for c, _ in found), [r for _, r in found]


def deltas(now: Mapping[str, float], then: Mapping[str, float]) -> dict[str, float]:
    """Counter increases since `then` (a counter that went backwards restarted: take `now`)."""
    out = {}
    for k, v in now.items():
        d = v - then.get(k, 0.0)
        d = v if d < 0 else d
        if d > 0:
            out[k] = d
    return out
