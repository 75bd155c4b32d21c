"""Numbers the MLX daemon side and worker side share; no MLX import, so the daemon may read them."""

PREFILL_STEP = 2048  # tokens per prefill pass (the spec's "2048-token passes")

# mlx-lm model types whose ``model.model(...)`` returns the final hidden states (after the final
# norm) and whose logits are the LM head (or the tied embedding) on them. For these the runner
# runs the head on the rows it needs only, and can pool hidden states into embeddings; the
# daemon declares ``embeddings`` for them alone.
HIDDEN_STATE_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
