"""The built-in named chat templates (plugins/formats/templates.py): registered through the plugin
manager as ``chat-template NAME`` finds them, each rendering a system + user + assistant + user
conversation with its role markers, BOS/EOS where the format has them, and a generation prompt
that the next turn's rendering starts with (so the prefix cache serves a conversation)."""

from __future__ import annotations

import pytest

from superfluid.core.chat import render_chat, template_caps
from superfluid.core.errors import ConfigError, InvalidRequest
from superfluid.core.formats.registry import load
from superfluid.core.formats.setup import chat_setup
from superfluid.core.plugins import make_plugin_manager
from superfluid.plugins.formats import templates

REQUIRED = ("chatml", "llama2", "llama3", "mistral-v1", "mistral-v3", "mistral-v7", "phi3", "phi4", "gemma",
            "zephyr", "vicuna", "deepseek", "deepseek3", "command-r", "granite", "openchat", "falcon3")
SYSTEM = {"role": "system", "content": "You are terse."}
USER1 = {"role": "user", "content": "What is 2+2?"}
REPLY = {"role": "assistant", "content": "4."}
USER2 = {"role": "user", "content": "And 3+3?"}
CONVERSATION = [SYSTEM, USER1, REPLY, USER2]
BOS, EOS = "<BOS>", "<EOS>"
NAMED = {t.name: t for t in templates.FORMATS}


def render(name: str, messages: list[dict], generation: bool = True) -> str:
    return render_chat(NAMED[name].template, messages, bos_token=BOS, eos_token=EOS,
                       add_generation_prompt=generation)


@pytest.fixture(scope="module")
def registry():
    return load(make_plugin_manager())


def test_every_llama_server_name_is_registered(registry):
    assert set(REQUIRED) <= set(registry.templates)
    for name in REQUIRED:
        assert registry.template(name) == NAMED[name].template
        assert registry.templates[name].description


@pytest.mark.parametrize("name", sorted(NAMED))
def test_a_conversation_renders_in_order_and_ends_with_the_generation_prompt(name):
    text = render(name, CONVERSATION)
    at = [text.find(m["content"]) for m in CONVERSATION]
    assert all(i >= 0 for i in at), (name, text)
    assert at == sorted(at), (name, text)
    # the generation prompt: what add_generation_prompt adds, at the very end
    closed = render(name, CONVERSATION, generation=False)
    assert text.startswith(closed)
    assert text.endswith(text[len(closed):])


@pytest.mark.parametrize("name", sorted(NAMED))
def test_each_turn_starts_with_the_previous_prompt(name):
    """The prompt for the reply is a prefix of the conversation that holds the reply, and that of
    the next prompt: what a model wrote is exactly the text between them."""
    prompt = render(name, [SYSTEM, USER1])
    with_reply = render(name, [SYSTEM, USER1, REPLY], generation=False)
    assert with_reply.startswith(prompt), name
    assert with_reply[len(prompt):].lstrip().startswith(REPLY["content"]), name
    assert render(name, CONVERSATION).startswith(with_reply), name


EXACT = {
    "chatml": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
              "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n",
    "llama2": "<BOS>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is 2+2? [/INST] 4. <EOS>"
              "<BOS>[INST] And 3+3? [/INST]",
    "llama3": "<BOS><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral-v3": "<BOS>[INST] You are terse.\n\nWhat is 2+2?[/INST] 4.<EOS>[INST] And 3+3?[/INST]",
    "mistral-v7": "<BOS>[SYSTEM_PROMPT] You are terse.[/SYSTEM_PROMPT][INST] What is 2+2?[/INST] 4.<EOS>"
                  "[INST] And 3+3?[/INST]",
    "gemma": "<BOS><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
             "<start_of_turn>model\n4.<end_of_turn>\n<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\nYou are terse.<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4.<|end|>\n"
            "<|user|>\nAnd 3+3?<|end|>\n<|assistant|>\n",
    "deepseek3": "<BOS>You are terse.<｜User｜>What is 2+2?<｜Assistant｜>4.<｜end▁of▁sentence｜>"
                 "<｜User｜>And 3+3?<｜Assistant｜>",
    "vicuna": "You are terse.\n\nUSER: What is 2+2?\nASSISTANT: 4.<EOS>\nUSER: And 3+3?\nASSISTANT:",
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_text(name):
    assert render(name, CONVERSATION) == EXACT[name]


def test_without_a_system_message_and_with_content_parts():
    parts = {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}
    assert render("gemma", [parts]) == "<BOS><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    assert render("llama2", [parts]) == "<BOS>[INST] What is 2+2? [/INST]"
    assert render("chatml", [parts], generation=False) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"


def test_a_role_the_format_lacks_is_refused_so_tool_results_are_written_as_text():
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    with pytest.raises(InvalidRequest, match="no role tool"):
        render("chatml", [USER1, tool])
    caps = template_caps(NAMED["chatml"].template)
    assert not caps.tools and not caps.tool_role  # the preparer describes tools and results as text


def test_chat_template_option_picks_a_named_template(registry):
    setup = chat_setup(None, registry, template_name="gemma")
    assert setup.source == "name:gemma" and setup.template == NAMED["gemma"].template
    assert setup.describe()["chat_template_source"] == "name:gemma"
    # a file wins over a name, and a name over the model's own
    assert chat_setup("{{ 'own' }}", registry, template_name="chatml").source == "name:chatml"
    with pytest.raises(ConfigError, match="unknown chat-template 'nope'"):
        chat_setup(None, registry, template_name="nope")
