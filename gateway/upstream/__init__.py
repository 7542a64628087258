"""Upstream connections: the HTTP/1.1 keep-alive pool (asyncio.Protocol + httptools) and the
pooled gRPC channels with server-reflection discovery. Leaves: they know endpoints, limits and
timeouts, never the policy holder or the chain."""
