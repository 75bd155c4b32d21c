"""OpenAI's Responses API (``POST /v1/responses``), as the ``openai`` SDK and Codex speak it, on
the shared preparation path and superfluid's sessions."""
