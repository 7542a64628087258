"""Rate limiting: compiled rules, the owner of their state, the background sync loop."""
