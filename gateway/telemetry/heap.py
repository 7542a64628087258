"""What the process holds in memory, for `GET /admin/debug/heap` (loopback only): the resident
set, the memory blocks Python has allocated (every object, including the ints and strings the
collector does not track: a leak of one small object per request shows as one block per
request), the live objects the garbage collector tracks counted by type (those created since
start-up: the server freezes what it built before serving), and, when the process runs
under `tracemalloc` (`PYTHONTRACEMALLOC=1` or `-X tracemalloc`), the memory traced and the
allocation sites holding most of it.

It answers "what grows?" on a running gateway without a restart: read it twice a minute apart
under steady load and compare (the soak benchmark and the soak tests do exactly that). Counting the
objects walks the whole heap (tens of milliseconds for a few hundred thousand objects), so it is
a tool for an operator, never a metric a scraper polls. `gc` is the collector's thresholds and, per
generation, its runs and the objects they freed since start (read before the report's own
collection): young-generation runs that free nothing, by the thousand, mean work for nothing.
"""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from collections import Counter
from typing import Any

__all__ = ["heap_report", "rss_bytes"]

TOP_TYPES = 40
TOP_SITES = 25


def rss_bytes() -> int:
    """The resident set of this process (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def heap_report(top: int = TOP_TYPES, collect: bool = True) -> dict[str, Any]:
    """The report as plain JSON values. `collect` runs a full collection first, so that what is
    counted is what is reachable (cycles awaiting the collector are not a leak)."""
    stats = gc.get_stats()  # before this report's own collection
    collector = {
        "threshold": list(gc.get_threshold()),
        "collections": [g["collections"] for g in stats],
        "collected": [g["collected"] for g in stats],
    }
    if collect:
        gc.collect()
    counts = Counter(type(o).__qualname__ for o in gc.get_objects())
    out: dict[str, Any] = {
        "rss_bytes": rss_bytes(),
        "allocated_blocks": sys.getallocatedblocks(),
        "gc_objects": sum(counts.values()),
        "types": dict(counts.most_common(max(1, top))),
        "gc": collector,
        "tracemalloc": None,
    }
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        snap = tracemalloc.take_snapshot().filter_traces(
            (tracemalloc.Filter(False, tracemalloc.__file__),)
        )
        sites = [
            {
                "where": f"{s.traceback[0].filename}:{s.traceback[0].lineno}",
                "bytes": s.size,
                "count": s.count,
            }
            for s in snap.statistics("lineno")[:TOP_SITES]
        ]
        out["tracemalloc"] = {"current_bytes": current, "peak_bytes": peak, "top_sites": sites}
    return out
