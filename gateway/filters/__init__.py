"""The filter chain: one protocol for every filter, one chain for both adapters."""
