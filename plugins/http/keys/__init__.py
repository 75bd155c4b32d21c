"""API keys and rate limits: the key policy file, the authenticating middleware, each key's
per-minute budgets and lanes, and the one token bucket every rate limit uses."""
