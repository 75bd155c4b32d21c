"""The two kinds of chat format a family has, as plugin authors write them.

:class:`ToolFormat`: one family's tool-call syntax. A subclass says how its template is
recognised (:meth:`~ToolFormat.detect`), how calls are read from a reply (:meth:`~ToolFormat.parse`),
and how one call is written (:meth:`~ToolFormat.call_choice`, :attr:`~ToolFormat.call_tail`), which
is what a forced call (``tool_choice`` required or a named function) is pre-filled and held to.

:class:`ReasoningFormat`: the markers of one family's thinking span. The default reading (a span
that opens the reply, or that the generation prompt opened) serves most families; a family with
another shape overrides :meth:`~ReasoningFormat.split`.

Both read text *whole* or *partial*. A partial read is of a reply still being generated: it must
hold back whatever may yet turn out to be a marker (``<tool_ca`` at the end), so that what it
returns is a prefix of what the whole read of any longer reply gives. The stream reader
(:mod:`.stream`) relies on that to send deltas."""

from __future__ import annotations

import abc
import copy
from typing import ClassVar

from ..request import JsonChoice
from .reply import ParsedCall


def partial_marker(text: str, *markers: str) -> int:
    """How many characters at the end of ``text`` could be the beginning of one of ``markers``
    (a proper prefix of it): what a partial read holds back."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def safe_content(text: str, partial: bool, *markers: str) -> str:
    """``text`` (content before any call) as a read returns it: whole, trailing whitespace cut
    only when partial (it may be the last before a call), and a partial marker held back."""
    if not partial:
        return text
    keep = partial_marker(text, *markers)
    return text[:len(text) - keep].rstrip()


class ToolFormat(abc.ABC):
    """One family's tool-call syntax. Instances are stateless and shared by every request."""

    #: the name ``tool-call-parser`` selects it by
    name: ClassVar[str]
    #: one line for ``superfluid template show`` and the docs
    description: ClassVar[str] = ""
    #: the reasoning format this family's templates use, when detection finds none of its own
    reasoning: ClassVar[str | None] = None
    #: True for a format that reads reasoning itself (gpt-oss' channels): :meth:`read` is its own
    reads_reasoning: ClassVar[bool] = False

    @abc.abstractmethod
    def detect(self, template: str) -> int:
        """How surely ``template`` (a chat template's source) is this family's: 0 not at all,
        higher is surer (the registry takes the highest). Markers the template writes for a call
        are the usual evidence."""

    @abc.abstractmethod
    def parse(self, text: str, partial: bool) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a reply's text after its reasoning span. Text that is not a call
        is content; calls None: a call's syntax is broken, so the whole reply is content. Partial:
        the reply goes on, so text that may become a marker is held back, and the last call may
        be unfinished (its name complete, its arguments a prefix)."""

    #: per tool name, the parameters its schema declares strings; set on a copy by
    #: :meth:`knowing_strings` (formats that write strings raw read a number-like text as text)
    strings: ClassVar[dict[str, frozenset[str]]] = {}

    def knowing_strings(self, strings: dict[str, frozenset[str]]) -> "ToolFormat":
        """This format for one request whose tools declare ``strings``: a copy that knows them,
        for formats whose values carry no type of their own (XML parameters: ``75001`` is a zip
        code where the schema says string). Formats that read JSON ignore it."""
        if not strings or not self.reads_raw_values:
            return self
        clone = copy.copy(self)
        clone.strings = strings
        return clone

    #: values are written raw, with no type of their own (XML-parameter syntaxes)
    reads_raw_values: ClassVar[bool] = False

    def is_string(self, tool: str, key: str) -> bool:
        """Whether the request's schema declares ``key`` of ``tool`` a string."""
        return key in self.strings.get(tool, ())

    # ---- writing one call (forced calls) ------------------------------------------------------

    def call_choice(self, function: dict) -> JsonChoice:
        """One call of ``function`` (an OpenAI tool's ``function`` object) as the model writes
        it, from the first character of the call: its literal ``lead`` then the arguments held to
        the function's ``parameters``. The default suits families whose arguments are a JSON
        object after :meth:`call_lead`."""
        return JsonChoice(self.call_lead(function["name"]), function.get("parameters") or {"type": "object"})

    def call_lead(self, name: str) -> str:
        """The text of a call up to its arguments object (families that use the default
        :meth:`call_choice`)."""
        raise NotImplementedError(f"{self.name}: no way to write a call")

    #: what closes a call after its arguments
    call_tail: ClassVar[str] = ""
    #: a marker that ends a call, which an engine without grammars stops a single forced call at
    #: (the reply must still read without it: stop strings are not part of the reply); "" for none
    call_stop: ClassVar[str] = ""

    # ---- reasoning formats that are part of the syntax ---------------------------------------

    def read(self, text: str, partial: bool, inside: bool):
        """(reasoning, content, calls) for a format that reads reasoning itself
        (:attr:`reads_reasoning`)."""
        raise NotImplementedError


class ReasoningFormat:
    """A family's thinking span: between ``start`` and ``end``."""

    def __init__(self, name: str, start: str, end: str, description: str = "", evidence: tuple[str, ...] = ()):
        self.name = name
        self.start = start
        self.end = end
        self.description = description
        #: strings whose presence in a template means the family reasons this way (default: both markers)
        self.evidence = evidence or (start, end)

    def detect(self, template: str) -> int:
        """How surely a template's family reasons with this span (0: no). Longer markers are
        surer evidence, so ``<seed:think>`` wins over ``<think>``."""
        return sum(len(e) for e in self.evidence) if all(e in template for e in self.evidence) else 0

    def opened_by(self, prompt: str) -> bool:
        """The rendered prompt ends inside an opened span (a generation prompt ending ``<think>``)."""
        head = prompt.rstrip()
        return head.endswith(self.start)

    def split(self, text: str, inside: bool, partial: bool) -> tuple[str, str]:
        """(reasoning, the rest) of a reply. A reply that does not open the span (after leading
        whitespace) is all rest; ``inside``: the prompt opened it. Whitespace next to the markers
        is trimmed; a span cut off (partial, or the reply's length limit) is reasoning so far."""
        head = text.lstrip()
        if head.startswith(self.start):  # the span opens (or, opened by the prompt, is opened again)
            inside, text = True, head[len(self.start):]
        elif partial and head and self.start.startswith(head):
            return "", ""  # may still become the start marker
        elif not inside:
            return "", text
        end = text.find(self.end)
        if end >= 0:
            return text[:end].strip(), text[end + len(self.end):].lstrip()
        if partial:
            keep = partial_marker(text, self.end)
            return text[:len(text) - keep].strip(), ""
        return text.strip(), ""

    def __repr__(self) -> str:
        return f"ReasoningFormat({self.name!r}, {self.start!r}, {self.end!r})"
