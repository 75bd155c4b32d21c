"""Echo engine (placeholder until the example lands)."""
