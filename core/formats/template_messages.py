"""A conversation as a chat template is rendered with it: the list of message dicts that
transformers' ``apply_chat_template`` passes, fitted to what this template reads.

Templates declare nothing, so what each one reads is probed by rendering it, once per template
(as :func:`superfluid.core.chat.template_caps` probes the tool fields):

- **content**: a string, or typed parts (``[{"type": "text", "text": …}, {"type": "image"}]``).
  A template that renders a list of text parts as it renders the same text given as a string
  loops over typed parts; one that renders only the list (SmolVLM's own) needs them. A message
  with images gets typed parts when the template writes something of its own for an image part
  (its placeholder: Mistral's ``[IMG]``, Gemma 4's ``<|image|>``, LFM2.5's ``<image>``), so the
  image is where the template puts it; the front end then puts the image's tokens at that
  placeholder. Otherwise (and for a template that prints the list's Python form) content is a
  string, with the front end's marker text where each image was. A message's text that holds
  the template's placeholder itself reaches the template escaped (:meth:`ContentCaps.hide`), so
  each placeholder in the render is an image's; a template that reads typed parts only gets at
  least one part per message (SmolVLM's own reads ``message['content'][0]``).
- **tool calls**: arguments as an object or as JSON text, ids as given or as 9 letters and
  digits (Mistral's), per :class:`~superfluid.core.chat.TemplateCaps`.
- **reasoning**: an assistant's reasoning as ``reasoning_content`` (Qwen3's templates render
  it), and also as ``thinking`` for templates that read that key (gpt-oss, LFM2.5)."""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from typing import Callable, NamedTuple

from ..chat import TemplateCaps, render_chat
from .conversation import Conversation, ImageRef, Message, TextPart

_FIRST, _SECOND = "superfluid_probe_7f3a", "superfluid_probe_9b1c"
_TEXT_ONLY = TemplateCaps(False, False, False, False)
# private-use characters no template writes: text's own placeholder (and this character itself)
# travels through the template escaped, to be told apart from the placeholders written for images
_ESCAPE, _ITSELF, _PLACEHOLDER = "\ue002", "\ue003", "\ue004"


class ContentCaps(NamedTuple):
    """How a template reads a message's content."""

    strings: bool = True   # it renders content given as a string
    parts: bool = False    # it renders typed text parts (as it renders the string, or only them)
    image: str = ""        # what it writes for a {"type": "image"} part ("": nothing of its own)

    @property
    def typed_images(self) -> bool:
        """Images go to the template as typed parts (it writes a placeholder where each goes)."""
        return self.parts and bool(self.image)

    def hide(self, text: str) -> str:
        """``text`` with the placeholder escaped: a user who writes ``[IMG]`` must not move an
        image, nor stop the template from placing the real ones."""
        if not self.image:
            return text
        return text.replace(_ESCAPE, _ESCAPE + _ITSELF).replace(self.image, _ESCAPE + _PLACEHOLDER)

    def show(self, text: str) -> str:
        """The rendered ``text`` with what :meth:`hide` escaped written back."""
        if _ESCAPE not in text:
            return text
        back = {_ITSELF: _ESCAPE, _PLACEHOLDER: self.image}
        return re.sub(f"{_ESCAPE}([{_ITSELF}{_PLACEHOLDER}])", lambda m: back[m.group(1)], text)


def _render(template: str, content) -> str | None:
    try:
        return render_chat(template, [{"role": "user", "content": content}], add_generation_prompt=False)
    except Exception:  # a template that raises on a shape does not take it
        return None


def _between(text: str | None) -> str | None:
    """The text a render writes between the two probe texts (None: not both, in order)."""
    if text is None or _FIRST not in text or _SECOND not in text:
        return None
    start = text.index(_FIRST) + len(_FIRST)
    end = text.find(_SECOND, start)
    return text[start:end] if end >= 0 else None


@functools.lru_cache(maxsize=16)
def content_caps(template: str | None) -> ContentCaps:
    """Probe how ``template`` reads content: a user message given as one string, as two text
    parts, and as two text parts with an image part between them."""
    if not template:
        return ContentCaps()
    text = {"type": "text"}
    as_string = _render(template, _FIRST + _SECOND)
    as_parts = _render(template, [text | {"text": _FIRST}, text | {"text": _SECOND}])
    strings = as_string is not None and _FIRST in as_string
    parts = _between(as_parts) is not None and (as_parts == as_string or not strings)
    if not parts:
        return ContentCaps(strings=strings)
    around = _between(as_parts)
    image = _between(_render(template, [text | {"text": _FIRST}, {"type": "image"}, text | {"text": _SECOND}]))
    if image is None or around.strip():
        return ContentCaps(strings=strings, parts=True)
    return ContentCaps(strings=strings, parts=True, image=image.strip())


def template_call_id(call_id: str | None, caps: TemplateCaps) -> str | None:
    """A call's id as the template takes it: for one that wants 9 letters and digits (Mistral's),
    a stable digest of the client's id, so a call and its result still match and every turn
    renders the same prefix."""
    if not caps.short_ids or call_id is None or (len(call_id) == 9 and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _typed(parts, content: ContentCaps) -> list[dict]:
    """Typed parts, consecutive texts joined (a template that trims each part trims the whole),
    the placeholder hidden in their text."""
    out: list[dict] = []
    for part in parts:
        if isinstance(part, ImageRef):
            out.append({"type": "image"})
        elif out and out[-1]["type"] == "text":
            out[-1]["text"] += part.text
        elif part.text:
            out.append({"type": "text", "text": part.text})
    return [{"type": "text", "text": content.hide(p["text"])} if p["type"] == "text" else p for p in out]


def _content(message: Message, content: ContentCaps, typed_images: bool, image_text, numbers) -> str | list[dict]:
    if typed_images and message.images:
        return _typed(message.parts, content)
    text = "".join(p.text if isinstance(p, TextPart) else (image_text(next(numbers)) if image_text else "")
                   for p in message.parts)
    if typed_images:
        text = content.hide(text)
    if content.parts and not content.strings:
        # a template that reads typed parts only; an empty message is one empty part, as a
        # template may read the first part's type (SmolVLM's own: ``message['content'][0]``)
        return [{"type": "text", "text": text}]
    return text


def _call(call, caps: TemplateCaps) -> dict:
    arguments = call.arguments if caps.object_arguments else call.text
    return {"id": template_call_id(call.id, caps), "type": "function",
            "function": {"name": call.name, "arguments": arguments}}


def template_messages(conversation: Conversation, caps: TemplateCaps | None = None,
                      content: ContentCaps | None = None, *, image_text: Callable[[int], str] | None = None,
                      typed_images: bool = False, thinking: bool = False) -> list[dict]:
    """The messages a template is rendered with. ``caps``/``content``: what it reads (default:
    content as strings, arguments as JSON text, ids as given); ``typed_images``: a message with
    images gets typed parts (``content.typed_images`` says whether the template places them);
    else ``image_text(k)`` is the text that stands for the k-th image of the conversation (its
    images are left out without it); ``thinking``: reasoning also as ``thinking``."""
    caps = caps or _TEXT_ONLY
    content = content or ContentCaps()
    numbers = itertools.count()
    out = []
    for m in conversation.messages:
        msg: dict = {"role": "system" if m.role == "developer" else m.role,
                     "content": _content(m, content, typed_images, image_text, numbers)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_call(c, caps) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = template_call_id(m.tool_call_id, caps)
        if m.reasoning is not None and m.role == "assistant":
            msg["reasoning_content"] = m.reasoning
            # gpt-oss refuses a call turn with both content and thinking: such a turn keeps its content
            if thinking and not (m.tool_calls and msg["content"]):
                msg["thinking"] = m.reasoning
        out.append(msg)
    return out
