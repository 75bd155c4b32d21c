"""An agent's next turn shows the model what it wrote: a reply in the family's own syntax, read
into an assistant message (content, reasoning, calls), sent back in the history as a client sends
it (OpenAI's shape, arguments a JSON string) and rendered through the model's own template (the
real ones in ../shared/templates), contains the text the model wrote."""

from __future__ import annotations

import json
import pathlib

import pytest

from superfluid.core.formats.reader import ReplyReader
from superfluid.plugins.formats import roundtrip
from superfluid.plugins.http.openai.chat_protocol import ChatCompletionRequest
from superfluid.plugins.http.prepare import tool_plan
from superfluid.plugins.http.prepare.tool_render import render_prompt
from superfluid.plugins.http.typed import parse

from .fakes import format_registry

TEMPLATES = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"
REGISTRY = format_registry()


@pytest.mark.parametrize("name", [
    "Qwen-Qwen3-0.6B", "Qwen3-Coder", "GLM-4.6", "Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Mistral-Nemo-Instruct-2407",
    "openai-gpt-oss-120b", "deepseek-ai-DeepSeek-V3.2", "MiniMax-M2", "ByteDance-Seed-OSS",
    "meta-llama-Llama-3.1-8B-Instruct", "moonshotai-Kimi-K2"])
def test_a_read_reply_renders_back_as_written(name):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    detected = REGISTRY.resolve(template)
    written = roundtrip.check(template, detected, calls=1, kwargs={"thinking": True} if "V3.2" in name else {})
    assert written.ok, written.note
    reader = ReplyReader(detected.tool_format, detected.reasoning,
                         inside=False if detected.reasoning is None else None or False)
    message = reader.read(written.output).openai_message(call_ids=["call_d41d8cd98f00b204e9800998"])
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    history = [roundtrip.SYSTEM, roundtrip.USER, message,
               {"role": "tool", "tool_call_id": "call_d41d8cd98f00b204e9800998", "content": "21C, sunny"}]
    req = parse(ChatCompletionRequest, {"messages": history, "tools": roundtrip.TOOLS})
    plan = tool_plan.plan(req, detected.tool_format)
    kwargs = {"thinking": True} if "V3.2" in name else {}
    prompt = render_prompt(template, req.conversation, plan, add_generation_prompt=True,
                           **kwargs)
    call_text = written.output.split(roundtrip.REASONING)[-1].lstrip()
    if "abcDEF123" in call_text:  # Mistral writes the call's id: the client's, shortened as the template wants
        call_text = call_text.split("abcDEF123")[0]
    if detected.reasoning is not None:  # the text after the span: the call as the model wrote it
        call_text = call_text.split(detected.reasoning.end)[-1].lstrip()
    assert call_text.strip() in prompt, (call_text, prompt)
    assert "21C, sunny" in prompt
