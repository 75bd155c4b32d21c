"""A VLM's own chat template places its images (core/formats/template_messages.py,
plugins/http/prepare/image_prompt.py): for each real template whose image branch loops over
typed parts, and for SmolVLM's own as SmolVLM publishes it, the prompt superfluid renders for a
conversation is exactly what transformers renders from the same typed parts, with each image's
marker standing where the template writes its placeholder, once per image, in order: one image
and two, text before, between and after, over several turns, with user text that holds the
placeholder's own characters, and with empty messages.

The expected text is rendered by transformers' ``render_jinja_template`` from typed parts written
out here by hand, not by superfluid's renderer or its message mapping."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest

from superfluid.core.formats.conversation import Conversation, ImageRef, Message, TextPart
from superfluid.core.formats.template_messages import ContentCaps, content_caps
from superfluid.plugins.http.prepare.image_prompt import marker
from superfluid.plugins.http.prepare.tool_format import ToolPlan
from superfluid.plugins.http.prepare.tool_render import render_prompt

render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parents[1] / "shared" / "templates"
SMOLVLM = ROOT / "data" / "templates" / "SmolVLM-Instruct.jinja"
BOS, EOS = "<s>", "</s>"
KIMI = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"

# the template's file and the placeholder it writes for an image part (the probe must find it)
TEMPLATES = {
    "Mistral-Small-3.2-24B-Instruct-2506": (SHARED, "[IMG]"),
    "mistralai-Ministral-3-14B-Reasoning-2512": (SHARED, "[IMG]"),
    "google-gemma-4-31B-it": (SHARED, "<|image|>"),
    "google-gemma-4-31B-it-interleaved": (SHARED, "<|image|>"),
    "moonshotai-Kimi-K2": (SHARED, KIMI),
    "Kimi-K2-Instruct": (SHARED, KIMI),
    "stepfun-ai-Step-3.5-Flash": (SHARED, "<im_patch>"),
    "Apriel-1.6-15b-Thinker-fixed": (SHARED, "[IMG]"),
    "LFM2.5-8B-A1B": (SHARED, "<image>"),
    "SmolVLM-Instruct": (SMOLVLM.parent, "<image>"),
}
PARTS_ONLY = {"SmolVLM-Instruct"}  # renders typed parts only: a string's text is lost


def _template(name: str) -> str:
    return (TEMPLATES[name][0] / f"{name}.jinja").read_text()


# A conversation is written once as (role, items): an item is text or IMAGE. It becomes both
# superfluid's Conversation and the typed messages transformers renders.
IMAGE = object()

CASES = {
    "one image, text before and after": [("user", ["Look at", IMAGE, " and say what it is."])],
    "image first": [("user", [IMAGE, "What colour is this?"])],
    "image alone": [("user", [IMAGE])],
    "two images, text around and between": [("user", ["Compare", IMAGE, " with", IMAGE, " now."])],
    "two images in a row": [("user", ["Both:", IMAGE, IMAGE, "Same?"])],
    "an image in each of two turns": [
        ("system", ["Answer in one word."]),
        ("user", ["First", IMAGE, "?"]), ("assistant", ["Red."]), ("user", [IMAGE, "And this one?"])],
}


def _conversation(turns) -> Conversation:
    messages = []
    for k, (role, items) in enumerate(turns):
        parts = tuple(ImageRef(SimpleNamespace(url=f"data:{k}/{i}", image=None)) if item is IMAGE else TextPart(item)
                      for i, item in enumerate(items))
        messages.append(Message(role, parts))
    return Conversation(messages)


def _typed(turns, parts_only: bool) -> list[dict]:
    """The messages as a VLM's processor hands them to its template: typed parts for a message
    with an image (or for every message, for a template that reads nothing else)."""
    out = []
    for role, items in turns:
        if IMAGE in items or parts_only:
            content = [{"type": "image"} if item is IMAGE else {"type": "text", "text": item} for item in items]
        else:
            content = "".join(items)
        out.append({"role": role, "content": content})
    return out


def _transformers(template: str, messages: list[dict]) -> str:
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=True,
                                        bos_token=BOS, eos_token=EOS)
    return rendered[0]


def _superfluid(template: str, conversation: Conversation) -> str:
    return render_prompt(template, conversation, ToolPlan(), add_generation_prompt=True, bos_token=BOS, eos_token=EOS)


def _marked(own: str, placeholder: str, count: int) -> str:
    """The template's own render with its k-th placeholder replaced by the k-th image's marker."""
    pieces = own.split(placeholder)
    assert len(pieces) == count + 1, f"the template wrote its placeholder {len(pieces) - 1} times for {count} images"
    return "".join(piece + (marker(k) if k < count else "") for k, piece in enumerate(pieces))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_probe_finds_the_templates_own_placeholder(name):
    caps = content_caps(_template(name))
    assert caps.typed_images and caps.image == TEMPLATES[name][1]
    assert caps.strings == (name not in PARTS_ONLY)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_image_stands_where_the_template_writes_its_placeholder(name, case):
    template, placeholder = _template(name), TEMPLATES[name][1]
    turns = CASES[case]
    count = sum(items.count(IMAGE) for _, items in turns)
    own = _transformers(template, _typed(turns, name in PARTS_ONLY))
    text = _superfluid(template, _conversation(turns))
    assert text == _marked(own, placeholder, count)
    assert placeholder not in text
    assert [text.count(marker(k)) for k in range(count)] == [1] * count
    positions = [text.index(marker(k)) for k in range(count)]
    assert positions == sorted(positions)  # in the order the messages hold them


STAND = "superfluid_stand_in_3e1d"  # where the user's text holds the placeholder's characters


@pytest.mark.parametrize("items", [[f"Is {STAND} a token?", IMAGE, f"Say {STAND}{STAND}."],
                                   [IMAGE, f"Is {STAND} a token? Say {STAND}{STAND}."]], ids=["between", "first"])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_user_text_holding_the_placeholder_stays_text_and_the_image_goes_where_the_template_puts_it(name, items):
    """(Kimi K2 writes a newline after an image, SmolVLM's own no space before a leading one:
    the image is placed by the template's image branch, not as text in its place.)"""
    template, placeholder = _template(name), TEMPLATES[name][1]
    stand = STAND
    turns = [("user", items)]
    own = _transformers(template, _typed(turns, name in PARTS_ONLY))
    asked = [("user", [item.replace(stand, placeholder) if isinstance(item, str) else item for item in turns[0][1]])]
    text = _superfluid(template, _conversation(asked))
    assert text == _marked(own, placeholder, 1).replace(stand, placeholder)
    assert text.count(marker(0)) == 1 and text.count(placeholder) == 3


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_escape_character_in_user_text_comes_back_unchanged(name):
    template = _template(name)
    odd = "odd \ue002\ue004 and \ue002\ue003 text"
    text = _superfluid(template, _conversation([("user", [odd, IMAGE])]))
    assert odd in text and text.count(marker(0)) == 1  # (Ministral 3 puts a lone image before the text)


def test_smolvlms_own_template_takes_empty_messages():
    """SmolVLM's own template reads ``message['content'][0]['type']``: a message with no text
    gets one empty text part, as an empty list would make the template fail (a 400)."""
    template = SMOLVLM.read_text()
    turns = [("system", [""]), ("user", [IMAGE, "Hi"]), ("assistant", [""]), ("user", ["Again?"])]
    text = _superfluid(template, _conversation(turns))
    own = _transformers(template, [{"role": role, "content": [
        {"type": "image"} if item is IMAGE else {"type": "text", "text": item} for item in items]}
        for role, items in turns])
    assert text == _marked(own, "<image>", 1)
    assert text.startswith("<|im_start|>System: <end_of_utterance>\nUser:" + marker(0) + "Hi<end_of_utterance>\n")


def test_smolvlms_own_template_is_the_one_smolvlm_publishes():
    """The file is SmolVLM-Instruct's template: what it renders for an image and a question."""
    text = _transformers(SMOLVLM.read_text(), [{"role": "user", "content": [{"type": "image"},
                                                                           {"type": "text", "text": "Hi"}]}])
    assert text == "<|im_start|>User:<image>Hi<end_of_utterance>\nAssistant:"


def test_hidden_text_comes_back_as_it_was():
    caps = ContentCaps(strings=True, parts=True, image="[IMG]")
    for text in ("plain", "[IMG]", "a[IMG]b[IMG]", "\ue002", "\ue002\ue004[IMG]\ue002\ue003", ""):
        hidden = caps.hide(text)
        assert "[IMG]" not in hidden and caps.show(hidden) == text
    assert ContentCaps().hide("[IMG]") == "[IMG]"  # a template that places no images: nothing to hide
