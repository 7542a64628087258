"""PolicyWatcher: reloads the policy when its file changes, by polling `stat` (no inotify).

The signature is `(st_dev, st_ino, st_mtime_ns, st_size)` of the *resolved* path (`os.stat`
follows symlinks), so all the usual ways of replacing a file are seen:

- in-place writes change mtime/size;
- editors that write a temp file and rename it over the original change the inode;
- Kubernetes ConfigMap volumes swap the `..data` symlink to a new directory: the path resolves to a
  different inode (inotify on the path itself misses this, a known kubelet pitfall).

A change is acted on only once the signature has stayed the same for `debounce_s` *and* two
reads of the file, `debounce_s` apart, returned the same bytes (so they parse to the same
content); the text handed to the holder is the one read twice, not a third read. A file written
in several chunks causes one reload of the final content, not an error per chunk, and a writer
that rewrites the file without changing its size within one mtime tick is caught by the second
read. A writer that pauses for longer than the window is not: for that, write the file the
atomic way (write `policy.yaml.tmp` in the same directory, fsync, `mv` it over `policy.yaml`:
rename(2) swaps it in one step; Kubernetes ConfigMap volumes already swap atomically), or give
the policy a `checksum:` or `end_marker:` (see the loader), and rely on the change guard, which
holds a half-file that would refuse most traffic.

A failed reload is not retried until the file changes again. The task never dies: any error is
logged and the next poll carries on. A missing file keeps the old policy (and is logged once).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from typing import Protocol

from gateway.policy.loader import MAX_BYTES
from gateway.reload.holder import ReloadResult

log = logging.getLogger("sluice.policy")

Signature = tuple[int, int, int, int]


class Reloadable(Protocol):
    @property
    def path(self) -> os.PathLike[str] | str: ...

    def reload(self, text: str | None = None) -> ReloadResult: ...


def file_signature(path: os.PathLike[str] | str) -> Signature | None:
    """Identity and version of the file `path` resolves to, or None if it cannot be stat'ed."""
    try:
        st = os.stat(path)  # follows symlinks: the ConfigMap `..data` swap changes st_ino
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class PolicyWatcher:
    def __init__(
        self, holder: Reloadable, interval_s: float = 1.0, debounce_s: float = 0.3
    ) -> None:
        if interval_s <= 0 or debounce_s < 0:
            raise ValueError("interval_s must be > 0 and debounce_s >= 0")
        self._holder = holder
        self.interval_s = interval_s
        self.debounce_s = debounce_s
        self._task: asyncio.Task[None] | None = None
        self._applied: Signature | None = None  # the signature last handed to reload()
        self._pending: Signature | None = None  # a new signature waiting to settle
        self._pending_since = 0.0
        self._first_read: tuple[bytes, float] | None = None  # (digest, when) of the first read
        self._missing_logged = False
        self.last_result: ReloadResult | None = None  # of the last reload this watcher caused

    def start(self) -> None:
        """Begin watching from the file as it is now (the holder loaded it at boot)."""
        if self._task is not None:
            return
        self._applied = file_signature(self._holder.path)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="policy-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.poll(time.monotonic())
            except Exception:  # never let the watcher die; the next poll tries again
                log.exception("policy watcher: poll failed")

    def poll(self, now: float) -> ReloadResult | None:
        """One look at the file; reloads if a change has settled. Returns the reload result."""
        sig = file_signature(self._holder.path)
        if sig is None:
            if not self._missing_logged:
                log.warning(
                    "policy file %s is missing; keeping the current policy", self._holder.path
                )
                self._missing_logged = True
            self._pending = None
            return None
        self._missing_logged = False
        if sig == self._applied:
            self._pending = None  # changed and changed back: nothing to do
            return None
        if sig != self._pending:
            self._pending, self._pending_since, self._first_read = sig, now, None
            if self.debounce_s > 0:
                return None
        if now - self._pending_since < self.debounce_s:
            return None
        raw = self._read()
        if raw is None or file_signature(self._holder.path) != sig:
            self._pending = None  # changed (or vanished) while we read it: start over
            return None
        digest = hashlib.sha256(raw).digest()
        first = self._first_read
        if first is None or first[0] != digest:
            self._first_read = (digest, now)
            if self.debounce_s > 0:
                return None  # read it once more, a window later
        elif now - first[1] < self.debounce_s:
            return None
        self._applied, self._pending, self._first_read = sig, None, None
        try:
            text: str | None = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None  # let the holder read it and report where the bad byte is
        result = self._holder.reload(text)
        self.last_result = result
        if result.ok and result.changed:
            log.info("policy file changed; now serving %s", result.version)
        return result

    def _read(self) -> bytes | None:
        try:
            with open(self._holder.path, "rb") as f:
                return f.read(MAX_BYTES + 1)
        except OSError:
            return None
