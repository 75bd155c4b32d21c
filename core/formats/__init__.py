"""Chat formats: how each model family writes tool calls and reasoning, and how a reply in that
format is read back into content, reasoning and calls.

A *tool-call format* (:class:`~.family.ToolFormat`) knows one family's syntax: how to find its
calls in a reply, how to write a forced call (so a grammar can hold it to the tool's schema), and
how to recognise its own chat template. A *reasoning format* (:class:`~.family.ReasoningFormat`)
knows the markers of a family's thinking span. Both are registered by name in a
:class:`~.registry.FormatRegistry` (plugins add theirs through ``superfluid_add_chat_formats``,
the built-in families in ``superfluid.plugins.formats`` among them), and detected from the
model's template as llama.cpp detects them, or chosen with ``tool-call-parser`` and
``reasoning-parser``.

A reply is read by a :class:`~.reader.ReplyReader` (the two formats and the request's tools),
whole or, through :class:`~.stream.StreamReader`, as it streams: the streamed deltas always sum
to what reading the whole reply gives."""
