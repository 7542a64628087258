"""(compiled) Member choice for LLM routing: among the members that serve the request's model, and
toward the member whose prefix cache holds the prompt's start, with bounded load.

Pure: plans come from `gateway.core.balancer`, `ok` says which members may take the request
(they serve its model, an earlier try did not use them), `random` is injected.

- **Prefix key**: the first `nbytes` bytes of the prompt (chat: the system messages first, then
  the others, in order; each message's role and text), hashed to 64 bits. Requests of one
  conversation, or sharing one long system prompt, get the same key.
- **Sticky placement with bounded load** (`gateway.core.placement`): the prefix stays on the
  member it was placed on (at first, the first of its weighted rendezvous order within its
  bound, so that losing a member moves only its own keys) until that member's time-averaged
  load passes `load_factor` × its weighted share; then the prefix moves, whole, to the next
  member of its order with room. A burst that fills a member right now spills single requests
  to the next members of the order instead of piling onto one.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Final, cast

from gateway.core.balancer import LOAD_GAIN, Candidate, Level, Plan, Random, mix
from gateway.core.placement import Placeable, PrefixBook, place

Ok = Callable[[Any], bool]
_SEED: Final = 0x5EED
_UNIT: Final = float(1 << 53)
_GOLDEN: Final = 0x9E3779B97F4A7C15  # spreads the CRC to 64 bits
_MASK: Final = (1 << 64) - 1
_SYSTEM: Final = b"system\x1f"  # how prompt_prefix starts a system message
_SYSTEM_CRC: Final = zlib.crc32(_SYSTEM)


def prompt_prefix(doc: dict[str, Any], nbytes: int) -> bytes:
    """The first `nbytes` bytes of the prompt of an OpenAI chat or completion body (b"" when
    it has none)."""
    messages = doc.get("messages")
    if isinstance(messages, list):
        first = messages[0] if messages else None
        if isinstance(first, dict) and first.get("role") == "system":
            content = first.get("content")
            if isinstance(content, str) and len(content) >= nbytes:  # a long system prompt
                return f"system\x1f{content[:nbytes]}".encode("utf-8", "surrogatepass")[:nbytes]
        ms = [m for m in messages if isinstance(m, dict)]
        if any(m.get("role") == "system" for m in ms[1:]):  # system prompts first
            ms = [m for m in ms if m.get("role") == "system"] + [
                m for m in ms if m.get("role") != "system"
            ]
        parts: list[str] = []
        size = 0
        for m in ms:
            role = m.get("role")
            piece = f"{role if isinstance(role, str) else ''}\x1f{_text(m.get('content'))}\x1e"
            parts.append(piece)
            size += len(piece)  # characters ≤ bytes: enough text is gathered
            if size >= nbytes:
                break
        text = "".join(parts)
    else:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        text = prompt[:nbytes] if isinstance(prompt, str) else ""
    return text.encode("utf-8", "surrogatepass")[:nbytes]


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
    # CRC-32 spread to 64 bits: the same in every process and replica, and ~3x cheaper than a
    # cryptographic hash of 2 KB; a collision only makes two prefixes share a member.
    messages = doc.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    if isinstance(first, dict) and first.get("role") == "system":
        content = first.get("content")
        if isinstance(content, str) and len(content) >= nbytes:  # a long system prompt: the
            text = content[:nbytes].encode("utf-8", "surrogatepass")  # same bytes as
            rest = memoryview(text)[: nbytes - len(_SYSTEM)]  # prompt_prefix, fewer copies
            return _spread(zlib.crc32(rest, _SYSTEM_CRC), len(_SYSTEM) + len(rest))
    prefix = prompt_prefix(doc, nbytes)
    if not prefix:
        return None
    return _spread(zlib.crc32(prefix), len(prefix))


def _spread(crc: int, size: int) -> int:
    return ((crc << 32 | size) * _GOLDEN) & _MASK


def score(m: Candidate) -> float:
    c = m.core
    return c.in_flight + c.load * LOAD_GAIN + c.server


def _levels(plan: Plan, r: float) -> list[Level]:
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


def pick_affinity(
    plan: Plan,
    key: int,
    load_factor: float,
    ok: Ok | None,
    book: PrefixBook,
    now: float,
    keep: bool = True,
) -> Placeable | None:
    """The member for prefix `key` (sticky placement with bounded load, `gateway.core.placement`)
    among those `ok` admits; the level by the key's own bits, the next levels when none there
    is admitted. `keep`: the choice may become the prefix's placement (not for a retry). The
    request is counted in the prefix's load: `book.finished` when it ends. The plan's members
    are placeable too (the pool's members are both)."""
    levels = plan.levels
    if len(levels) == 1 and ok is None:
        lv = levels[0]
        everyone = cast("tuple[Placeable, ...]", lv.members)
        return place(book, everyone, key, load_factor, now, lv.uniform, keep)
    for lv in _levels(plan, ((mix(key, _SEED) >> 11) + 0.5) / _UNIT):
        members = [cast("Placeable", m) for m in lv.members if ok is None or ok(m)]
        if members:
            return place(book, members, key, load_factor, now, lv.uniform, keep)
    return None


def pick_allowed(plan: Plan, random: Random, ok: Ok) -> Candidate | None:
    """Weighted power of two choices among the members `ok` admits (the level by `random`, the
    next levels when none there is admitted)."""
    for lv in _levels(plan, random()):
        members = [m for m in lv.members if ok(m)]
        n = len(members)
        if n == 0:
            continue
        if n == 1:
            return members[0]
        total = sum((m.weight for m in members), 0.0)  # a float sum (mypyc)
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
