"""Sluice: a traffic-control gateway and sidecar for LLM inference backends."""

from __future__ import annotations

from gateway.native import guard

__version__ = "0.1.0"

guard()  # before any module of the request path: compiled, or all from source (gateway.native)
