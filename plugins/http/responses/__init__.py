"""OpenAI's Responses API (``/v1/responses``), the API Codex speaks, as a front end over the chat
path: a typed request (:mod:`.protocol`) is mapped onto a chat completion (:mod:`.mapping`), run
by the OpenAI routes' generation run, and answered as a ``response`` object or its stream of
events (:mod:`.wire`). A stored response is a session turn (:mod:`.chains`), so
``previous_response_id`` sends only the new items and the prefix cache serves the rest."""
