"""Telemetry: metrics (every metric defined once) and tracing."""
