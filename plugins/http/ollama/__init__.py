"""Ollama's native API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``, …), for
the tools that speak only it: typed requests (``protocol.py``), their mapping onto chat and
completion requests (``mapping.py``), NDJSON replies (``wire.py``) and the routes."""
