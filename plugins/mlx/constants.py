"""Numbers the MLX daemon side and worker side share; no MLX import, so the daemon may read them."""

PREFILL_STEP = 2048  # tokens per prefill pass (the spec's "2048-token passes")
