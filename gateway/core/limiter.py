"""(compiled) Per-key limiter arithmetic: a sliding-window request counter and an LLM-token bucket.

Pure: callers pass `now` (seconds) and the parameters; nothing here reads a clock or does I/O.
The state objects are small mutable `__slots__` records rather than frozen values because a
frozen copy per decision costs about a microsecond, a fifth of a rule's budget; every method
is still a function of (state, parameters, now). `gateway/store/lua/bucket.lua` implements the
same arithmetic inside Redis (a contract test keeps the two in agreement).

- `Window`: the sliding-window counter of Cloudflare's write-up: two fixed windows, the
  previous one weighted by the part of it the sliding window still overlaps. O(1) memory and
  time, and within a few percent of an exact sliding log. It counts two things: requests
  *offered* (every arrival: the demand signal the overload colour reads) and requests
  *admitted* (what the limit is checked against, so refused requests do not lock a client out).
- `Bucket`: a token bucket of `rate` tokens per second up to `burst`. It admits while it is not
  empty and may go into debt (down to -burst) when a reservation or a reconciled usage is
  larger than what is left: the average rate holds, the debt is repaid by the refill.
"""

from __future__ import annotations

import math


class Window:
    __slots__ = ("size", "idx", "cur", "prev", "ocur", "oprev")

    def __init__(self, size: float) -> None:
        self.size = size
        self.idx = -1
        self.cur = 0.0  # admitted in the current fixed window
        self.prev = 0.0  # admitted in the previous one
        self.ocur = 0.0  # offered, current
        self.oprev = 0.0  # offered, previous

    def roll(self, now: float) -> float:
        """Move to the fixed window holding `now`; return how far into it `now` is (0..1)."""
        pos = now / self.size
        idx = math.floor(pos)
        if idx != self.idx:
            if idx == self.idx + 1:
                self.prev, self.oprev = self.cur, self.ocur
            else:  # first use, or idle for more than a window (or time went back: forget)
                self.prev = self.oprev = 0.0
            self.cur = self.ocur = 0.0
            self.idx = idx
        return pos - idx

    def admitted(self, now: float) -> float:
        f = self.roll(now)
        return self.prev * (1.0 - f) + self.cur

    def offered(self, now: float) -> float:
        f = self.roll(now)
        return self.oprev * (1.0 - f) + self.ocur

    def offer(self, now: float) -> None:
        self.roll(now)
        self.ocur += 1.0

    def admit(self, now: float, n: float = 1.0) -> None:
        self.roll(now)
        self.cur += n

    def unadmit(self, n: float = 1.0) -> None:
        """Give back admissions that did not go ahead (refused in a later phase)."""
        self.cur -= n
        if self.cur < 0.0:
            self.prev = max(0.0, self.prev + self.cur)
            self.cur = 0.0

    def retry_after(self, now: float, limit: float) -> float:
        """Seconds until one more request fits under `limit` (0 if it fits now)."""
        f = self.roll(now)
        est = self.prev * (1.0 - f) + self.cur
        if est + 1.0 <= limit:
            return 0.0
        size = self.size
        if self.cur + 1.0 <= limit and self.prev > 0.0:
            # Within this window the estimate falls by prev/size per second.
            return (est + 1.0 - limit) * size / self.prev
        # Wait for the next window, where the current count becomes the weighted previous one.
        rest = (1.0 - f) * size
        if self.cur <= 0.0 or limit < 1.0:
            return rest + size
        return rest + size * max(0.0, 1.0 - (limit - 1.0) / self.cur)


class Bucket:
    __slots__ = ("tokens", "updated")

    def __init__(self, tokens: float, now: float) -> None:
        self.tokens = tokens
        self.updated = now

    def level(self, rate: float, burst: float, now: float) -> float:
        """Refill up to `now` and return the tokens available (negative: in debt)."""
        dt = now - self.updated
        if dt > 0.0:
            t = self.tokens + dt * rate
            self.tokens = burst if t > burst else t
            self.updated = now
        return self.tokens

    def take(self, rate: float, burst: float, now: float, n: float) -> bool:
        """`level`, then, if the bucket is not empty, `add(-n)`: one call for a reservation."""
        dt = now - self.updated
        t = self.tokens
        if dt > 0.0:
            t = t + dt * rate
            t = self.tokens = burst if t > burst else t
            self.updated = now
        if t <= 0.0:
            return False
        t = t + -n
        self.tokens = burst if t > burst else (-burst if t < -burst else t)
        return True

    def add(self, n: float, burst: float) -> None:
        """Refund (n > 0) or charge (n < 0); the balance stays within [-burst, burst]."""
        t = self.tokens + n
        self.tokens = burst if t > burst else (-burst if t < -burst else t)

    def retry_after(self, rate: float, burst: float, now: float) -> float:
        """Seconds until the bucket is no longer empty (it admits while tokens > 0)."""
        t = self.level(rate, burst, now)
        if t > 0.0:
            return 0.0
        return (1e-9 - t) / rate if rate > 0.0 else math.inf

    def forgive(self) -> None:
        """What a red colour's reset does: a debt is written off (the balance goes to zero,
        not to full); a bucket with tokens left keeps them."""
        if self.tokens < 0.0:
            self.tokens = 0.0


def utilisation(tokens: float, burst: float) -> float:
    """Token utilisation = 1 - available / capacity (above 1 while the bucket is in debt)."""
    return 1.0 - tokens / burst
