"""Chat formats by name, and which a template's family uses.

Detection is by evidence in the template, as llama.cpp reads its templates: each tool-call format
scores how surely a template writes calls its way (:meth:`~.family.ToolFormat.detect`), each
reasoning format whether the template holds its markers, and the highest score wins. A model's
``tool-call-parser`` and ``reasoning-parser`` options name a format instead (``none``: no
parsing); ``auto`` detects."""

from __future__ import annotations

import attrs

from ..errors import ConfigError
from .family import ReasoningFormat, ToolFormat

AUTO, NONE = "auto", "none"


@attrs.frozen
class Detected:
    """The formats a model's replies are read with, and whether each was detected or chosen."""

    tool_format: ToolFormat | None
    reasoning: ReasoningFormat | None
    tool_source: str = AUTO  # "auto" (detected from the template) or "option" (tool-call-parser)
    reasoning_source: str = AUTO

    def describe(self) -> dict:
        """For /v1/models, /api/show and the startup log."""
        return {"tool_call_parser": self.tool_format.name if self.tool_format else None,
                "tool_call_parser_source": self.tool_source,
                "reasoning_parser": self.reasoning.name if self.reasoning else None,
                "reasoning_parser_source": self.reasoning_source}


@attrs.frozen
class NamedTemplate:
    """A chat template a model can be given by name (``chat-template NAME``), registered through
    ``superfluid_add_chat_formats`` like a format."""

    name: str
    template: str
    description: str = ""


class FormatRegistry:
    """Tool-call and reasoning formats, registered by plugins (``superfluid_add_chat_formats``)."""

    def __init__(self):
        self.tool_formats: dict[str, ToolFormat] = {}
        self.reasoning_formats: dict[str, ReasoningFormat] = {}
        self.templates: dict[str, NamedTemplate] = {}

    def add(self, fmt) -> None:
        """Register a :class:`ToolFormat`, a :class:`ReasoningFormat` or a named chat template
        (:class:`NamedTemplate`); its name must be new among those of its kind."""
        table = (self.reasoning_formats if isinstance(fmt, ReasoningFormat)
                 else self.templates if isinstance(fmt, NamedTemplate) else self.tool_formats)
        if fmt.name in table or fmt.name in (AUTO, NONE):
            raise ConfigError(f"chat format {fmt.name!r} is registered twice (or is a reserved name)")
        table[fmt.name] = fmt

    def tool_format(self, name: str) -> ToolFormat:
        try:
            return self.tool_formats[name]
        except KeyError:
            raise ConfigError(f"unknown tool-call-parser {name!r}; known: "
                              + ", ".join(sorted(self.tool_formats) + [AUTO, NONE])) from None

    def reasoning_format(self, name: str) -> ReasoningFormat:
        try:
            return self.reasoning_formats[name]
        except KeyError:
            raise ConfigError(f"unknown reasoning-parser {name!r}; known: "
                              + ", ".join(sorted(self.reasoning_formats) + [AUTO, NONE])) from None

    def template(self, name: str) -> str:
        """The text of a named chat template (``chat-template NAME``)."""
        try:
            return self.templates[name].template
        except KeyError:
            raise ConfigError(f"unknown chat-template {name!r}; known: {', '.join(sorted(self.templates)) or 'none'} "
                              "(or give a file with chat-template-file)") from None

    def detect_tool_format(self, template: str | None) -> ToolFormat | None:
        if not template:
            return None
        scored = [(fmt.detect(template), fmt.name) for fmt in self.tool_formats.values()]
        score, name = max(scored, default=(0, None))
        return self.tool_formats[name] if score > 0 else None

    def detect_reasoning(self, template: str | None, tool_format: ToolFormat | None = None) -> ReasoningFormat | None:
        if not template:
            return None
        if tool_format is not None and tool_format.reads_reasoning:
            return None
        scored = [(fmt.detect(template), fmt.name) for fmt in self.reasoning_formats.values()]
        score, name = max(scored, default=(0, None))
        if score > 0:
            return self.reasoning_formats[name]
        if tool_format is not None and tool_format.reasoning in self.reasoning_formats:
            return self.reasoning_formats[tool_format.reasoning]
        return None

    def resolve(self, template: str | None, tool_parser: str = AUTO, reasoning_parser: str = AUTO) -> Detected:
        """The formats for a model with ``template``, given its two options."""
        if tool_parser == AUTO:
            tool, tool_source = self.detect_tool_format(template), AUTO
        else:
            tool = None if tool_parser == NONE else self.tool_format(tool_parser)
            tool_source = "option"
        if reasoning_parser == AUTO:
            reasoning, reasoning_source = self.detect_reasoning(template, tool), AUTO
        else:
            reasoning = None if reasoning_parser == NONE else self.reasoning_format(reasoning_parser)
            reasoning_source = "option"
        return Detected(tool, reasoning, tool_source, reasoning_source)


def load(pm) -> FormatRegistry:
    """The registry every plugin of ``pm`` fills."""
    registry = FormatRegistry()
    pm.hook.superfluid_add_chat_formats(register=registry.add)
    return registry
