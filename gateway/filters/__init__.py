"""The filter chain: one protocol for every filter, one chain for HTTP and gRPC,
built per policy (`registry`)."""
