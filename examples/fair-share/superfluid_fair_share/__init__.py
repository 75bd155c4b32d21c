"""Fair-share admission (placeholder until the example lands)."""
