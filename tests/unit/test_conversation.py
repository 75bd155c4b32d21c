"""The one conversation value every front end maps onto (core/formats/conversation.py), what a
chat template is given for it (core/formats/template_messages.py), and images placed where a
real template puts them (plugins/http/prepare/image_prompt.py): for each template of the corpus
that loops over typed parts and writes its own placeholder for an image, the image's marker
lands exactly where the template writes that placeholder."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest

from superfluid.core.chat import TemplateCaps, render_chat
from superfluid.core.formats.conversation import Conversation, ImageRef, Message, TextPart, ToolCall
from superfluid.core.formats.template_messages import ContentCaps, content_caps, template_messages
from superfluid.core.media import Image, VisionInfo
from superfluid.plugins.http.prepare.image_prompt import marker, tokenize_with_images
from superfluid.plugins.http.prepare.tool_format import ToolPlan
from superfluid.plugins.http.prepare.tool_render import render_prompt

TEMPLATES = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"

# the real templates that loop over typed parts and write an image placeholder of their own
PLACEHOLDERS = {
    "Mistral-Small-3.2-24B-Instruct-2506": "[IMG]",
    "mistralai-Ministral-3-14B-Reasoning-2512": "[IMG]",
    "google-gemma-4-31B-it": "<|image|>",
    "google-gemma-4-31B-it-interleaved": "<|image|>",
    "moonshotai-Kimi-K2": "<|media_start|>image<|media_content|><|media_pad|><|media_end|>",
    "Kimi-K2-Instruct": "<|media_start|>image<|media_content|><|media_pad|><|media_end|>",
    "stepfun-ai-Step-3.5-Flash": "<im_patch>",
    "Apriel-1.6-15b-Thinker-fixed": "[IMG]",
    "unsloth-Apriel-1.5": "[IMG]",
    "LFM2.5-8B-A1B": "<image>",
}

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# a template in the shape of SmolVLM's own: it reads typed parts only (a string's text is lost)
PARTS_ONLY = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: "
              "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
              "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
              "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def _image(name: str = "a") -> ImageRef:
    return ImageRef(SimpleNamespace(url=f"data:{name}", image=None), where=f"img:{name}")


def _look(*images: ImageRef) -> Conversation:
    """One user message: text, the images, text."""
    return Conversation([Message("user", (TextPart("Look:"), *images, TextPart(" What is it?")))])


def _render(template: str, conversation: Conversation) -> str:
    return render_prompt(template, conversation, ToolPlan(), add_generation_prompt=True)


@pytest.mark.parametrize("name", sorted(PLACEHOLDERS))
def test_an_image_lands_where_the_real_template_puts_it(name):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    placeholder = PLACEHOLDERS[name]
    assert content_caps(template).image == placeholder  # probed, not told
    own = render_chat(template, [{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": " What is it?"}]}],
        add_generation_prompt=True)
    assert own.count(placeholder) == 1
    text = _render(template, _look(_image()))
    assert text == own.replace(placeholder, marker(0))  # the marker exactly where the template writes its image
    assert "Look:" + marker(0) in text and placeholder not in text


@pytest.mark.parametrize("name", ["Mistral-Small-3.2-24B-Instruct-2506", "google-gemma-4-31B-it", "LFM2.5-8B-A1B"])
def test_images_of_several_turns_are_numbered_in_order(name):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    conversation = Conversation([
        Message("user", (_image("a"), TextPart("First?"))), Message.plain("assistant", "Red."),
        Message("user", (TextPart("And"), _image("b"), _image("c")))])
    text = _render(template, conversation)
    assert text.index(marker(0)) < text.index("Red.") < text.index(marker(1)) < text.index(marker(2))
    assert text.index("And") < text.index(marker(1))
    assert PLACEHOLDERS[name] not in text


def test_a_template_that_writes_no_placeholder_gets_markers_in_its_text():
    assert content_caps(CHATML) == ContentCaps(strings=True, parts=False, image="")
    assert _render(CHATML, _look(_image())) == (f"<|im_start|>user\nLook:{marker(0)} What is it?<|im_end|>\n"
                                                "<|im_start|>assistant\n")


def test_user_text_holding_the_placeholder_falls_back_to_markers_in_text():
    template = (TEMPLATES / "Mistral-Small-3.2-24B-Instruct-2506.jinja").read_text()
    conversation = Conversation([Message("user", (TextPart("What is [IMG]?"), _image()))])
    text = _render(template, conversation)
    assert f"What is [IMG]?{marker(0)}" in text  # the client's [IMG] stays text; the image is its own


def test_a_template_that_reads_typed_parts_only_gets_them_for_every_message():
    assert content_caps(PARTS_ONLY) == ContentCaps(strings=False, parts=True, image="<image>")
    conversation = Conversation([Message.plain("system", "Be brief."), Message("user", (_image(), TextPart("Hi")))])
    assert _render(PARTS_ONLY, conversation) == (f"<|im_start|>System: Be brief.<end_of_utterance>\n"
                                                 f"User: {marker(0)}Hi<end_of_utterance>\nAssistant:")


def test_the_marked_prompt_tokenizes_with_the_image_rows_at_the_placeholder():
    template = (TEMPLATES / "Mistral-Small-3.2-24B-Instruct-2506.jinja").read_text()
    image = Image.from_rgb(1, 1, b"\x01\x02\x03")
    ref = SimpleNamespace(url="data:x", image=image)
    vision = VisionInfo(tile=1, rows=3, before=(900,), after=(901,))
    engine = SimpleNamespace(info=SimpleNamespace(vision=vision),
                             tokenize=lambda s, **kw: [ord(c) for c in s])
    text = _render(template, _look(ImageRef(ref)))
    tokens, spans = tokenize_with_images(SimpleNamespace(engine=engine), text, [ref], lambda s: [ord(c) for c in s])
    start = spans[0].start
    assert "".join(map(chr, tokens[:start - 1])).endswith("Look:")
    assert tokens[start - 1] == 900 and tokens[start + 3] == 901 and spans[0].rows == 3
    assert "".join(map(chr, tokens[start + 4:])).startswith(" What is it?")


# ---- the value and the messages a template is given -----------------------------------------------

def test_tool_call_arguments_are_objects_and_keep_the_text_they_were_sent_as():
    sent = ToolCall.of("c1", "f", '{"a":1}')
    assert sent.arguments == {"a": 1} and sent.text == '{"a":1}'  # rendered as the model wrote it
    given = ToolCall.of("c2", "f", {"b": "é"})
    assert given.text == '{"b": "é"}'
    broken = ToolCall.of("c3", "f", "{not json")
    assert broken.arguments == "{not json" and broken.text == "{not json"


def test_template_messages_fit_what_the_template_reads():
    conversation = Conversation([
        Message.plain("developer", "Rules."),
        Message("assistant", (), (ToolCall.of("call_long_client_id", "f", '{"a":1}'),), reasoning="hmm"),
        Message.plain("tool", "ok", tool_call_id="call_long_client_id", name="f")])
    plain = template_messages(conversation)
    assert plain[0] == {"role": "system", "content": "Rules."}
    assert plain[1] == {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
        {"id": "call_long_client_id", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}
    assert plain[2] == {"role": "tool", "content": "ok", "name": "f", "tool_call_id": "call_long_client_id"}
    mistral = TemplateCaps(tools=True, tool_calls=True, tool_role=True, object_arguments=True, short_ids=True)
    fitted = template_messages(conversation, mistral, thinking=True)
    call = fitted[1]["tool_calls"][0]
    assert call["function"]["arguments"] == {"a": 1} and len(call["id"]) == 9 and call["id"].isalnum()
    assert fitted[2]["tool_call_id"] == call["id"]  # the call and its result still match
    assert fitted[1]["thinking"] == "hmm"


def test_images_without_a_marker_are_left_out_of_the_text():
    assert template_messages(_look(_image())) == [{"role": "user", "content": "Look: What is it?"}]
    typed = template_messages(_look(_image()), content=ContentCaps(True, True, "[IMG]"), typed_images=True)
    assert typed[0]["content"] == [{"type": "text", "text": "Look:"}, {"type": "image"},
                                   {"type": "text", "text": " What is it?"}]


def test_hermes_history_keeps_a_results_images_where_they_were():
    conversation = Conversation([
        Message("assistant", (), (ToolCall.of("c1", "read", {"path": "a.png"}),)),
        Message("tool", (TextPart("Here:"), _image()), tool_call_id="c1")])
    text = _render(CHATML, conversation)
    assert f"<tool_response>\nHere:{marker(0)}\n</tool_response>" in text
    assert '<tool_call>\n{"name": "read", "arguments": {"path": "a.png"}}\n</tool_call>' in text
