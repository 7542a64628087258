"""Smooth weighted round robin (the nginx algorithm): an even interleaving, no bursts per peer.

Pure: the state is a list of current weights; `pick` returns an index into the peers given at
construction. Peers with weight 0 are never picked.
"""

from __future__ import annotations

from collections.abc import Sequence


class SmoothWeightedRoundRobin:
    __slots__ = ("_weights", "_current", "_total", "_single")

    def __init__(self, weights: Sequence[float]) -> None:
        self._weights = [float(w) for w in weights]
        self._current = [0.0] * len(self._weights)
        self._total = sum(w for w in self._weights if w > 0)
        live = [i for i, w in enumerate(self._weights) if w > 0]
        self._single = live[0] if len(live) == 1 else None

    def pick(self) -> int | None:
        """Index of the next peer, or None when every weight is 0."""
        if self._single is not None:
            return self._single
        if self._total <= 0:
            return None
        best = -1
        best_w = 0.0
        cur = self._current
        for i, w in enumerate(self._weights):
            if w <= 0:
                continue
            cur[i] += w
            if best < 0 or cur[i] > best_w:
                best, best_w = i, cur[i]
        cur[best] -= self._total
        return best
