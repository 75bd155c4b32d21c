"""ServiceNow Apriel (1.5 and 1.6 Thinker): the reasoning span. The reply opens with ``Here are
my reasoning steps:`` (1.6's generation prompt writes it for the model), the reasoning runs to
``[BEGIN FINAL RESPONSE]``, and the answer after it may be closed by ``[END FINAL RESPONSE]``
(1.5's system prompt asks for both markers; 1.6's only for the first).

Both write their calls as ``<tool_calls>[...]</tool_calls>``, read by :mod:`.apriel15`'s format,
which detects both templates."""

from __future__ import annotations

from superfluid.core.formats.family import ReasoningFormat, partial_marker

START, BEGIN, END = "Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]", "[END FINAL RESPONSE]"


class AprielReasoning(ReasoningFormat):
    """The span is the reply's start up to ``[BEGIN FINAL RESPONSE]``; the answer's closing
    marker is taken off the rest (a call after it stays). Detected by the final-response marker,
    which both templates' system prompts name."""

    def __init__(self):
        super().__init__("apriel", START, BEGIN, "Here are my reasoning steps: ... [BEGIN FINAL RESPONSE] "
                         "... [END FINAL RESPONSE] (Apriel 1.5, 1.6)", evidence=(BEGIN,))

    def split(self, text: str, inside: bool, partial: bool) -> tuple[str, str]:
        reasoning, rest = super().split(text, inside, partial)
        end = rest.find(END)
        if end >= 0:
            return reasoning, rest[:end] + rest[end + len(END):]
        if partial:
            rest = rest[:len(rest) - partial_marker(rest, END)]
        return reasoning, rest


FORMATS = (AprielReasoning(),)
