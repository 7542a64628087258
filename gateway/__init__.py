"""Sluice: a traffic-control gateway and sidecar for LLM inference backends."""

from __future__ import annotations

__version__ = "0.1.0"
