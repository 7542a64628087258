"""Telemetry: metrics (every metric defined once), tail-sampled tracing (`tracing`; the spans of
kept requests in `spans`) and the batched access log (`accesslog`)."""
