"""A served model's chat: the template it renders with, where that came from, and the formats its
replies are read with. Settled once when the model loads (:func:`chat_setup`), logged, and shown
by ``/v1/models``, ``/api/show`` and ``superfluid template show``.

The template is, first to last: ``chat-template-file`` (a Jinja file), ``chat-template`` (a name
the registry knows, see ``superfluid template list``), then the model's own (GGUF metadata or its
tokenizer config). A model with none cannot chat: its chat requests are refused with a 400 that
names the two options (llama-server would fall back to ChatML, which a base model was never trained
on, so its replies would look like chat and mean nothing)."""

from __future__ import annotations

import pathlib

import attrs

from ..errors import ConfigError
from .registry import AUTO, Detected, FormatRegistry, NamedTemplate  # noqa: F401  (NamedTemplate: imported from here too)


@attrs.frozen
class ChatSetup:
    """What a model chats with. ``source``: "model" (its own template), "file:PATH",
    "name:NAME", or "none"."""

    template: str | None
    source: str
    detected: Detected = Detected(None, None)

    def describe(self) -> dict:
        """For /v1/models, /api/show, the startup log and ``superfluid template show``."""
        return {"chat_template_source": self.source, **self.detected.describe()}


def chat_setup(own: str | None, registry: FormatRegistry, *, template_file: str | None = None,
               template_name: str | None = None, tool_parser: str = AUTO, reasoning_parser: str = AUTO) -> ChatSetup:
    """The chat of a model whose own template is ``own``, given its options."""
    if template_file:
        path = pathlib.Path(template_file).expanduser()
        try:
            template, source = path.read_text(encoding="utf-8"), f"file:{path}"
        except OSError as exc:
            raise ConfigError(f"chat-template-file {template_file!r} cannot be read: {exc.strerror or exc}") from None
    elif template_name:
        template, source = registry.template(template_name), f"name:{template_name}"
    elif own:
        template, source = own, "model"
    else:
        template, source = None, "none"
    if template is not None:
        _compiles(template, source)
    return ChatSetup(template, source, registry.resolve(template, tool_parser, reasoning_parser))


def _compiles(template: str, source: str) -> None:
    """A template that does not even compile is refused at startup, not at the first chat."""
    import jinja2

    from ..chat import _compile

    try:
        _compile(template)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"chat template ({source}) does not compile: {exc}") from None


def chat_of(runtime) -> ChatSetup:
    """A runtime's chat setup: the one its daemon settled, or (a runtime built by hand) its
    engine's own template, read without a family format."""
    setup = getattr(runtime, "chat", None)
    if setup is not None:
        return setup
    own = runtime.engine.info.chat_template
    return ChatSetup(own, "model" if own else "none")
