"""The simulated backend's prefix cache and prefill cost: what makes prompt-prefix routing
measurable without a GPU.

A prompt is cut into blocks of `prefix_block_chars` characters; block i is keyed by a hash of
blocks 0..i (as vLLM's automatic prefix caching keys KV blocks by their whole prefix), so a
block is reused only after the same start. An LRU keeps `prefix_cache_blocks` of them. A
request's time to first token is `ttft_ms` + `uncached_token_ms` × its prompt tokens (chars / 4)
from the first block not in the cache on; its prefill holds one of `prefill_slots` (0 = no
limit), so uncached prompts queue behind each other as on a busy GPU.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class CacheStats:
    hit_tokens: int = 0
    miss_tokens: int = 0


class PrefixCache:
    def __init__(self) -> None:
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.stats = CacheStats()
        self._slots: asyncio.Semaphore | None = None
        self._slots_n = 0

    def lookup(self, text: str, block_chars: int, capacity: int) -> int:
        """Characters of `text` not served from the cache (and now cached)."""
        if capacity <= 0:
            return len(text)
        h = hashlib.blake2b(digest_size=16)
        cached = 0
        missed = False
        for start in range(0, len(text), block_chars):
            h.update(text[start : start + block_chars].encode("utf-8", "surrogatepass"))
            key = h.digest()
            if not missed and key in self.blocks:
                self.blocks.move_to_end(key)
                cached += min(block_chars, len(text) - start)
                continue
            missed = True
            self.blocks[key] = None
            while len(self.blocks) > capacity:
                self.blocks.popitem(last=False)
        uncached = len(text) - cached
        self.stats.hit_tokens += cached // 4
        self.stats.miss_tokens += uncached // 4
        return uncached

    def slots(self, n: int) -> asyncio.Semaphore | None:
        """The prefill slots (`n` 0: none, prefill never waits)."""
        if n <= 0:
            return None
        if self._slots is None or self._slots_n != n:
            self._slots, self._slots_n = asyncio.Semaphore(n), n
        return self._slots

    def clear(self) -> None:
        self.blocks.clear()
        self.stats = CacheStats()
