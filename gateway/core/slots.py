"""Backend slots shared by a fleet: what a replica asks the store for, what it gives back, when
it syncs, and what it may use when the store is away. Pure: the edge (`gateway.fleet.slots`)
measures the queue, runs `lua/slots.lua` (which applies `fair_target` and the grant rule below
atomically in the store) and sleeps as `next_sync` says.

The invariant the store keeps: Σ held over live replicas ≤ the pool's `total` (its
`max_in_flight` × members, for the whole fleet). A replica's *grant* is what its queue may
dispatch into; what it *holds* in the store is max(in use, grant), so a replica told to shrink
keeps counting the slots its running requests occupy until they end, and a slot is granted to
another replica only once it is free in the store. So while the store answers, the member never
runs more than `total`, during rebalancing too: a replica takes a slot only from the free ones.

A replica that dies (SIGKILL) stops renewing: its entry expires after `ttl_s` and its slots are
free again within ttl + one sync. With the store away every replica uses `fallback_share`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RENEW_FRACTION = 0.25  # renew a held lease every ttl × this
MIN_TTL_S = 1.0
TTL_SYNCS = 20  # a lease lives this many sync intervals (at least MIN_TTL_S)
BACKOFF_MAX = 8  # a replica at its fair share asks again at most every 8 intervals (≤ renew)


def lease_ttl(interval_s: float) -> float:
    """The lifetime of a lease: 20 sync intervals, at least a second."""
    return max(MIN_TTL_S, TTL_SYNCS * interval_s)


def want(busy: int, waiting: int, total: int) -> int:
    """Slots a replica asks for: those in use and waited for, plus one of headroom while it
    serves (the next arrival dispatches without waiting for a sync); none when idle."""
    if busy <= 0 and waiting <= 0:
        return 0
    return min(total, busy + waiting + 1)


def fair_target(total: int, wants: list[int], mine: int) -> int:
    """Max-min fair share (water-filling) of `total` slots over the replicas' `wants`, for a
    replica wanting `mine` (already in `wants`): every want below the level is met, the others
    get the level, rounded up (the store grants only free slots, so rounding up never passes
    `total`; it only lets the first to ask take the remainder)."""
    level = math.inf
    left = float(total)
    ws = sorted(wants)
    for i, w in enumerate(ws):
        share = left / (len(ws) - i)
        if w <= share:
            left -= w
            continue
        level = share
        break
    if mine <= level:
        return mine
    return min(mine, math.ceil(level - 1e-9))


def grant(
    total: int, want_: int, target: int, others_held: int, recovering_cap: int | None = None
) -> int:
    """What the store grants: the fair target, bounded by what is free (total − the others'
    held) and, while the store recovers its state (`recovering_cap`), by the fallback share."""
    g = min(want_, target, total - others_held)
    if recovering_cap is not None:
        g = min(g, recovering_cap)
    return max(0, g)


def fallback_share(total: int, replicas: int) -> int:
    """With the store away: the pool's total ÷ live replicas (last known), rounded down, at
    least 1 (so Σ ≤ max(total, replicas))."""
    return max(1, total // max(1, replicas))


@dataclass(slots=True)
class Reply:
    grant: int
    held: int
    fleet_held: int  # Σ held of live replicas, this one's included (after this sync)
    fleet_in_use: int  # Σ in use of live replicas (as each last reported)
    target: int
    contended: bool  # Σ wants > total: idle slots are worth giving back at once


def next_sync(
    now: float,
    interval_s: float,
    ttl_s: float,
    want_: int,
    r: Reply,
    backoff: int,
) -> tuple[float | None, int]:
    """When this replica syncs a pool again (None: not until its demand changes), and the
    backoff to use next: at once (next interval) while its grant moves toward its fair target
    or it holds slots it does not want while others wait, or it drains toward a smaller grant
    (each slot it frees is free in the store at the next sync); at the renewal period while it
    holds slots or waits at its fair share (backing off from one interval to at most 8); never
    while it neither holds nor wants any."""
    renew = ttl_s * RENEW_FRACTION
    if r.held <= 0 and want_ <= 0:
        return None, 1
    if r.held > r.grant:
        return now + interval_s, 1  # draining to a smaller grant: free each slot as it ends
    if want_ > r.grant:
        if r.target > r.grant:
            return now + interval_s, 1  # slots are on their way: ask again soon
        step = min(backoff * interval_s, renew)
        return now + step, min(backoff * 2, BACKOFF_MAX)
    if r.grant > want_ and r.contended:
        return now + interval_s, 1  # give the surplus back at the next sync
    return now + renew, 1


def due_now(want_: int, asked: int, grant_: int, target: int, contended: bool) -> bool:
    """Whether a change of demand seen between syncs is worth a sync before the scheduled
    one: a pool newly wanted, demand beyond the grant when the last ask was met in full (the
    fair share may be larger than that ask; when the fair share capped it, the scheduled sync
    asks again), or a surplus others wait for."""
    if asked == 0 and want_ > 0:
        return True
    if want_ > grant_ and target >= asked:
        return True
    return grant_ > want_ and contended
