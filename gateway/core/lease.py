"""(compiled) Leased shares: what a key reports at a sync, and how the store's answer becomes its
new share. Pure: the sync loop does the I/O.

At each sync every active key reports, in one op: requests it admitted without a lease (a
charge) or the unused part of its request share (given back), the token balance of its share
(given back, or charged when it went below zero) and of anything it took without a lease, the
requests that arrived (demand), and the share it wants next: what arrived since the last sync
times `HEADROOM`, at least one request and one typical reservation. A key idle for `IDLE_S`
wants nothing: it gives its share back and stops being synced.

The round trip takes time while requests keep coming: the answer's grant is corrected by what
the key used between the report and the answer, so nothing is counted twice or lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from gateway.core.keystate import KeyState, RuleMath

HEADROOM: Final = 1.5
IDLE_S: Final = 2.0


@dataclass(slots=True)
class Report:
    req_delta: float
    tok_delta: float
    offered: float
    want_req: float
    want_tok: float
    reset: bool
    # What the key held when it reported (to correct the grant for use during the trip).
    leased: bool
    req_share: float
    tok_share: float

    @property
    def idle(self) -> bool:
        return self.want_req == 0.0 and self.want_tok == 0.0


def report(ks: KeyState, m: RuleMath, now: float, min_tokens: float) -> Report | None:
    """The op of one key; None when it has nothing to say. Moves the reported counts out of
    the key (`restore` puts them back if the sync fails)."""
    idle = now - ks.last > IDLE_S
    pending = ks.adm_unleased or ks.tok_unleased or ks.off_since or ks.reset
    if not ks.leased and not pending:
        return None
    req_delta = ks.adm_unleased - (ks.req_share if ks.leased else 0.0)
    tok_delta = (ks.tok_share if ks.leased else 0.0) - ks.tok_unleased
    want_req = want_tok = 0.0
    if not idle:
        if m.limit > 0.0:
            want_req = min(m.limit, float(math.ceil(ks.off_since * HEADROOM)) + 1.0)
        if m.rate > 0.0:
            want_tok = min(m.burst, max(ks.tok_used * HEADROOM, min_tokens))
    r = Report(
        req_delta, tok_delta, ks.off_since, want_req, want_tok, ks.reset,
        ks.leased, ks.req_share, ks.tok_share,
    )  # fmt: skip
    ks.adm_unleased = ks.tok_unleased = ks.off_since = ks.tok_used = 0.0
    ks.reset = False
    return r


def apply(
    ks: KeyState,
    r: Report,
    granted_req: float,
    granted_tok: float,
    admitted: float,
    offered: float,
    tokens: float,
) -> None:
    """The store's answer: the new share, corrected by what was used during the trip, and the
    global picture the key decides against until the next sync."""
    used_req = (r.req_share - ks.req_share) if r.leased and ks.leased else 0.0
    used_tok = (r.tok_share - ks.tok_share) if r.leased and ks.leased else 0.0
    ks.g_adm, ks.g_off, ks.g_tok = admitted, offered, tokens
    if r.idle:
        # Nothing wanted: the share went back. What was taken during the trip is charged next.
        ks.leased = False
        ks.adm_unleased += max(0.0, used_req)
        ks.tok_unleased += used_tok
        ks.req_share = ks.tok_share = 0.0
        return
    ks.leased = True
    ks.req_share = granted_req - used_req
    ks.tok_share = granted_tok - used_tok


def restore(ks: KeyState, r: Report) -> None:
    """The sync failed: the key decides locally again, and what it reported is reported again
    at the next successful sync (a lost share is simply not used; what was taken beyond it is
    still charged)."""
    ks.off_since += r.offered
    if r.leased:
        beyond_req = max(0.0, -ks.req_share)
        beyond_tok = max(0.0, -ks.tok_share)
        ks.adm_unleased += r.req_delta + r.req_share + beyond_req
        ks.tok_unleased += -(r.tok_delta - r.tok_share) + beyond_tok
    else:
        ks.adm_unleased += r.req_delta
        ks.tok_unleased -= r.tok_delta
    ks.reset = ks.reset or r.reset
    ks.leased = False
    ks.req_share = ks.tok_share = 0.0


def drop(ks: KeyState) -> None:
    """Go local without a report (the store went away between syncs): the unused share is
    lost, what was taken beyond it is charged at the next successful sync."""
    if ks.leased:
        ks.adm_unleased += max(0.0, -ks.req_share)
        ks.tok_unleased += max(0.0, -ks.tok_share)
    ks.leased = False
    ks.req_share = ks.tok_share = 0.0
