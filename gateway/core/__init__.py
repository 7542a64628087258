"""Pure decision logic: stdlib only (tests/core/test_purity.py enforces it)."""
