"""Routes that change what the server keeps between requests: sessions (conversations, turn by
turn) and admin (unloading and loading models)."""
