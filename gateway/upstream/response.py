"""(compiled) `UpstreamResponse`: the head of an upstream answer and a chunk reader over its
connection."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.errors import UpstreamProtocolError
from gateway.upstream.conn import LOW_WATER, Stale, UpstreamConn


class UpstreamResponse:
    """Status, reason and raw headers of an upstream response; its body is read in chunks.

    Call `release()` (or `await aclose()`) exactly when done: the connection goes back to the
    pool only if the body was read to its end and keep-alive holds, otherwise it is closed.
    """

    __slots__ = ("status", "reason", "headers", "_conn", "_held")

    def __init__(self, conn: UpstreamConn) -> None:
        self.status = conn.status
        self.reason = conn.reason.decode("latin-1")
        self.headers = conn.headers
        self._conn: UpstreamConn | None = conn
        self._held: list[bytes] = []

    def hold(self, chunks: list[bytes]) -> None:
        """Chunks read ahead (a stream held until its first token): `read_chunk` gives them
        again, in order, before the rest of the body."""
        self._held = chunks + self._held

    def take(self) -> bytes | None:
        """What `read_chunk` would give without waiting (b"" at the end of the body); None: it
        must wait (or fail), call `read_chunk`. Saves a coroutine when the body is here."""
        if self._held:
            return self._held.pop(0)
        conn = self._conn
        if conn is None:
            return b""
        if conn.chunks:
            chunk = conn.chunks.popleft()
            conn.buffered -= len(chunk)
            if conn.paused and conn.buffered <= LOW_WATER and not conn.closed:
                conn.paused = False
                assert conn.transport is not None
                conn.transport.resume_reading()
            return chunk
        if conn.complete:
            self.release()
            return b""
        return None

    async def read_chunk(self) -> bytes:
        """The next body chunk as it arrived; b"" at the end of the body."""
        while True:
            chunk = self.take()
            if chunk is not None:
                return chunk
            conn = self._conn
            assert conn is not None
            exc = conn.exc
            if exc is not None:
                self.release()
                raise exc if not isinstance(exc, Stale) else UpstreamProtocolError("closed")
            await conn.wait()

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return _Chunks(self)

    @property
    def complete(self) -> bool:
        if self._held:
            return False
        return self._conn is None or (self._conn.complete and not self._conn.chunks)

    def release(self) -> None:
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        conn.host.put(conn)

    def discard(self) -> None:
        """Done with a response we refused (e.g. an invalid head): never reuse its connection."""
        conn = self._conn
        if conn is not None:
            conn.keep_alive = False
        self.release()

    async def aclose(self) -> None:
        self.release()


class _Chunks:
    """`UpstreamResponse.iter_chunks` (a class: mypyc compiles no async generators)."""

    __slots__ = ("resp",)

    def __init__(self, resp: UpstreamResponse) -> None:
        self.resp = resp

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.resp.read_chunk()
        if not chunk:
            raise StopAsyncIteration
        return chunk
