"""KV events (``--kv-events tcp://…``) for llm-d's precise prefix scorer (placeholder until the
publisher lands)."""
