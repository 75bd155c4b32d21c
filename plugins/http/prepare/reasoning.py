"""A reasoning model's chat, prepared: the span its reply opens with (the model's
``reasoning-parser``, detected from its chat template when "auto", settled when the model loaded:
:mod:`superfluid.core.formats.setup`), the template variables that switch its thinking on or off
(``enable_thinking``), and the thinking budget its sampling enforces
(:mod:`superfluid.core.think_budget`)."""

from __future__ import annotations

import attrs

from superfluid.core import reasoning as reasoning_
from superfluid.core.errors import InvalidRequest
from superfluid.core.formats.setup import chat_of
from superfluid.core.request import ThinkBudget


@attrs.define(frozen=True)
class Reasoning:
    """How a chat's reply opens: its family's reasoning span (a
    :class:`~superfluid.core.formats.family.ReasoningFormat`), and whether the prompt opened it
    (the reply starts inside)."""

    format: object
    inside: bool = False

    @property
    def markers(self) -> reasoning_.Markers:
        return reasoning_.Markers(self.format.start, self.format.end)

    def parser(self) -> reasoning_.ReasoningParser:
        """A token-by-token follower of the span (what counts the reasoning tokens)."""
        return reasoning_.ReasoningParser(self.markers, inside=self.inside)


#: what a chat template is always given; chat_template_kwargs may not set them
_TEMPLATE_OWN = frozenset({"messages", "tools", "bos_token", "eos_token", "add_generation_prompt",
                           "continue_final_message", "documents"})


def render_flags(req) -> dict:
    """How a chat's prompt ends, and its documents: ``add_generation_prompt`` (default true,
    false when ``continue_final_message`` is set), ``continue_final_message``, ``documents``."""
    keep_going = bool(getattr(req, "continue_final_message", None))
    generation = getattr(req, "add_generation_prompt", None)
    return {"add_generation_prompt": (not keep_going) if generation is None else generation,
            "continue_final_message": keep_going, "documents": getattr(req, "documents", None)}


def template_kwargs(req) -> dict:
    """The extra variables a chat's template is rendered with: ``chat_template_kwargs`` as sent,
    and ``enable_thinking`` (Qwen3's switch) from ``reasoning_effort`` ("none" and "minimal": off;
    any other: on) unless the kwargs set it. A template without the switch ignores it."""
    kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
    for key in kwargs:
        if key in _TEMPLATE_OWN:
            raise InvalidRequest(f"chat_template_kwargs may not set {key!r}: the server sets it",
                                 param="chat_template_kwargs", code="invalid_value")
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = effort not in ("none", "minimal")
    return kwargs


def reasoning_of(runtime, prompt: str) -> Reasoning | None:
    """How a chat on ``runtime`` whose rendered prompt is ``prompt`` opens its reply: the span
    its model's chat settled on, None for a model that does not reason (or whose tool-call format
    reads its reasoning itself, as gpt-oss' channels do)."""
    fmt = chat_of(runtime).detected.reasoning
    if fmt is None:
        return None
    return Reasoning(fmt, inside=fmt.opened_by(prompt))


def thinking_budget(req, runtime, thinks: Reasoning | None, sampling):
    """``sampling`` with a chat's ``thinking_budget`` (a reasoning model's span held to that many
    tokens, :class:`superfluid.core.request.ThinkBudget`), when its model reasons and the reply is
    parsed for a span; a model that does not reason ignores it, as a template without the switch
    ignores ``enable_thinking``."""
    budget = getattr(req, "thinking_budget", None)
    if budget is None or thinks is None:
        return sampling
    if not getattr(runtime.engine.capabilities, "grammars", False):
        raise InvalidRequest(f"model {runtime.name!r} cannot enforce a thinking budget: its engine does not "
                             "constrain sampling", param="thinking_budget", code="unsupported_value")
    markers = thinks.markers
    return attrs.evolve(sampling, think_budget=ThinkBudget(
        budget, close=markers.end, open=None if thinks.inside else markers.start))
