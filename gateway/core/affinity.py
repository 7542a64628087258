"""Member choice for LLM routing: among the members that serve the request's model, and toward
the member whose prefix cache holds the prompt's start, with bounded load.

Pure: plans come from `gateway.core.balancer`, `ok` says which members may take the request
(they serve its model, an earlier try did not use them), `random` is injected.

- **Prefix key**: the first `nbytes` bytes of the prompt (chat: the system messages first, then
  the others, in order; each message's role and text), hashed to 64 bits. Requests of one
  conversation, or sharing one long system prompt, get the same key.
- **Bounded-load rendezvous** (consistent hashing with bounded loads, Mirrokni et al. 2018, on
  rendezvous hashing so that losing a member moves only its own keys): the members of the level
  are ordered by their weighted rendezvous score for the key; the first whose load after taking
  the request, `(in_flight + heartbeat load / 10 + 1) / weight`, stays within `load_factor` ×
  the level's mean `(Σ in_flight + Σ load / 10 + 1) / Σ weight` takes it. The least loaded
  member always qualifies (it is at or below the mean), so the walk always ends; a hot prefix
  spills to the next members in its own order instead of piling onto one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any, TypeVar

from gateway.core.balancer import LOAD_GAIN, Candidate, Level, Plan, Random, mix

M = TypeVar("M", bound=Candidate)
Ok = Callable[[Any], bool]
_SEED = 0x5EED
_UNIT = float(1 << 53)


def prompt_prefix(doc: dict[str, Any], nbytes: int) -> bytes:
    """The first `nbytes` bytes of the prompt of an OpenAI chat or completion body (b"" when
    it has none)."""
    messages = doc.get("messages")
    parts: list[str] = []
    size = 0
    if isinstance(messages, list):
        system = [m for m in messages if isinstance(m, dict) and m.get("role") == "system"]
        rest = [m for m in messages if isinstance(m, dict) and m.get("role") != "system"]
        for m in system + rest:
            if size >= nbytes:
                break
            text = _text(m.get("content"))
            role = m.get("role")
            piece = f"{role if isinstance(role, str) else ''}\x1f{text}\x1e"
            parts.append(piece)
            size += len(piece)  # characters ≤ bytes: enough text is gathered
    else:
        prompt = doc.get("prompt")
        if isinstance(prompt, str):
            parts.append(prompt[:nbytes])
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            parts.append(prompt[0][:nbytes])
    return "".join(parts).encode("utf-8", "surrogatepass")[:nbytes]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def prefix_key(doc: dict[str, Any], nbytes: int) -> int | None:
    """The 64-bit key of the prompt's prefix, or None for a body without a prompt."""
    prefix = prompt_prefix(doc, nbytes)
    if not prefix:
        return None
    return int.from_bytes(hashlib.blake2b(prefix, digest_size=8).digest(), "big")


def score(m: Candidate) -> float:
    c = m.core
    return c.in_flight + c.load * LOAD_GAIN


def _rendezvous(key: int, m: Candidate) -> float:
    u = ((mix(key, m.hash_key) >> 11) + 0.5) / _UNIT
    return m.weight / -math.log(u)


def bounded_order(members: list[M], key: int, load_factor: float) -> M | None:
    """The first of `members` in the key's rendezvous order whose load stays within
    `load_factor` × the mean (see the module docstring)."""
    if not members:
        return None
    if len(members) == 1:
        return members[0]
    total_w = sum(m.weight for m in members)
    total_l = sum(score(m) for m in members)
    cap = load_factor * (total_l + 1.0) / total_w
    ranked = sorted(members, key=lambda m: _rendezvous(key, m), reverse=True)
    for m in ranked:
        if (score(m) + 1.0) / m.weight <= cap:
            return m
    return min(ranked, key=lambda m: (score(m) + 1.0) / m.weight)  # rounding: the least loaded


def _levels(plan: Plan[M], r: float) -> list[Level[M]]:
    """The plan's levels, the one `r` falls in first (the others in priority order after it)."""
    levels = plan.levels
    if len(levels) == 1:
        return [levels[0]]
    first = levels[-1]
    for lv, hi in zip(levels, plan.cum_load, strict=True):
        if r < hi:
            first = lv
            break
    return [first, *(lv for lv in levels if lv is not first)]


def pick_affinity(plan: Plan[M], key: int, load_factor: float, ok: Ok | None) -> M | None:
    """The member for prefix `key` (bounded-load rendezvous) among those `ok` admits; the level
    by the key's own bits, the next levels when none there is admitted."""
    for lv in _levels(plan, ((mix(key, _SEED) >> 11) + 0.5) / _UNIT):
        members = [m for m in lv.members if ok is None or ok(m)]
        if members:
            return bounded_order(members, key, load_factor)
    return None


def pick_allowed(plan: Plan[M], random: Random, ok: Ok) -> M | None:
    """Weighted power of two choices among the members `ok` admits (the level by `random`, the
    next levels when none there is admitted)."""
    for lv in _levels(plan, random()):
        members = [m for m in lv.members if ok(m)]
        n = len(members)
        if n == 0:
            continue
        if n == 1:
            return members[0]
        total = sum(m.weight for m in members)
        x = random() * total
        i = 0
        run = members[0].weight
        while run <= x and i < n - 1:
            i += 1
            run += members[i].weight
        j = int(random() * (n - 1))
        if j >= i:
            j += 1
        a, b = members[i], members[j]
        return a if score(a) / a.weight <= score(b) / b.weight else b
    return None
