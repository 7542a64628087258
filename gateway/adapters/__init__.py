"""Adapters: translate between the wire (aiohttp HTTP/1.1, grpc.aio) and the filter chain."""

from __future__ import annotations
