"""Anthropic's Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``), as the
``anthropic`` SDK and Claude Code speak it. A request is typed (:mod:`.protocol`, :mod:`.blocks`),
mapped onto the chat request the OpenAI front end runs (:mod:`.mapping`), run by that front end's
generation path, and its reply translated back (:mod:`.wire`, :mod:`.message`). See docs/api.md,
"Anthropic Messages"."""
