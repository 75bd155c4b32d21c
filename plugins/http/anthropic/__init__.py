"""Anthropic's Messages API (``POST /v1/messages``), as the ``anthropic`` SDK and Claude Code
speak it, on the shared preparation path."""
