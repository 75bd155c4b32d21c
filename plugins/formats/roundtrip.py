"""The round trip llama.cpp's chat tests make, for one template: render a conversation up to the
generation prompt, render it again with an assistant reply (reasoning, one call or two), take the
text between the two as what the model would have written, read it back with the detected
formats, and compare with the reply that was rendered.

The reply is rendered in the first shape the template takes (the traps of real templates:
arguments as an object or as a JSON string, content empty or null, Mistral's 9-character ids).
What a template does not render (reasoning that it drops, a call it writes as nothing) is not
expected back. ``superfluid template check`` runs it; docs/formats.md is its table over the
corpus."""

from __future__ import annotations

import codecs
import json
from typing import Iterator

import attrs

from superfluid.core.chat import render_chat
from superfluid.core.formats.reader import ReplyReader
from superfluid.core.formats.registry import Detected
from superfluid.core.formats.stream import StreamReader

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is the weather in Paris?"}
REASONING = "The user wants the weather in Paris. I should call get_weather."
CALLS = (("get_weather", {"city": "Paris"}, "abcDEF123"), ("get_time", {"timezone": "Europe/Paris"}, "ghiJKL456"))

#: what ends a model's turn, as templates write it: not part of what the model's reply is read from
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|return|>", "<|call|>", "</s>",
               "<|end_of_text|>", "<end_of_turn>", "<turn|>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>",
               "<|endoftext|>", "<seed:eos>", "[e~[", "<|im_end|>", "<|end_of_sentence|>", "<|eot|>",
               "<|end_of_role|>", "<|im_end_of_text|>", "<|turn_end|>", "[/TOOL_CALLS]",
               "<|start_header_id|>assistant<|end_header_id|>")

#: template variables some templates need to render at all: none; DeepSeek V3.2's thinking mode
#: (its prompt otherwise closes a span its history never writes); Firefunction v2's ``functions``
#: and ``datetime``
TEMPLATE_KWARGS = ({}, {"thinking": True},
                   {"functions": json.dumps([t["function"] for t in TOOLS]), "datetime": "2026-12-06 12:00"})


@attrs.frozen
class RoundTrip:
    """One template's round trip: ``output`` the model's text; ``expected`` and ``got`` the
    assistant message rendered and read back (OpenAI's shape, arguments as objects)."""

    ok: bool
    output: str = ""
    expected: dict | None = None
    got: dict | None = None
    note: str = ""


def end_of_turn_cut(text: str, extra: tuple[str, ...] = ()) -> str:
    """``text`` without the end-of-turn marker(s) and whitespace the template put after the reply."""
    changed = True
    while changed:
        changed = False
        stripped = text.rstrip()
        for marker in (*extra, *END_OF_TURN):
            if marker and stripped.endswith(marker):
                text, changed = stripped[:-len(marker)], True
                break
    return text


def assistant_variants(calls: int, reasoning: bool) -> Iterator[dict]:
    """The reply in every shape templates want, most common first."""
    for as_object in (True, False):
        for content in ("", None):
            msg: dict = {"role": "assistant", "content": content}
            if reasoning:
                msg["reasoning_content"] = REASONING
            if calls:
                msg["tool_calls"] = [{"id": cid, "type": "function", "function": {
                    "name": name, "arguments": args if as_object else json.dumps(args)}}
                    for name, args, cid in CALLS[:calls]]
            else:
                msg["content"] = "It is sunny in Paris."
            yield msg
            if reasoning:  # gpt-oss reads the reasoning from "thinking"
                yield {**{k: v for k, v in msg.items() if k != "reasoning_content"}, "thinking": REASONING}
            if not calls:
                break


def _render(template: str, messages: list[dict], generation: bool, bos: str, eos: str, kwargs: dict) -> str:
    return render_chat(template, messages, bos_token=bos, eos_token=eos, add_generation_prompt=generation,
                       tools=TOOLS, **kwargs)


def model_output(template: str, reply: dict, *, bos: str = "", eos: str = "", kwargs: dict | None = None,
                 history: list[dict] | None = None, markers: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(the generation prompt, the text the model wrote for ``reply``), or None when the template
    will not render the reply, or renders the earlier turns differently once it follows. A
    generation prompt that opens (or opens and closes) a reasoning span that the history does not
    repeat (``markers``: the span's) is taken without those markers: the prompt returned is then
    the one the history continues."""
    kwargs = kwargs or {}
    history = history if history is not None else [SYSTEM, USER]
    try:
        prompt = _render(template, history, True, bos, eos, kwargs)
        full = _render(template, [*history, reply], False, bos, eos, kwargs)
    except Exception:  # noqa: BLE001 - a template that refuses this shape
        return None
    if full.startswith(prompt):
        return prompt, end_of_turn_cut(full[len(prompt):], (eos,))
    head, changed = prompt.rstrip(), True
    while changed:  # the span's markers at the prompt's end, in any order
        changed = False
        for marker in markers:
            if marker and head.endswith(marker):
                head, changed = head[:-len(marker)].rstrip(), True
    if head != prompt.rstrip() and full.startswith(head):
        output = end_of_turn_cut(full[len(head):].lstrip(), (eos,))
        # a history that writes the span itself continues the prompt that opened it; one that
        # drops it continues the prompt without it
        opened = len(markers) > 1 and markers[1] and output.startswith(markers[1])
        return (head if opened or not any(m and m in output for m in markers) else prompt), output
    return None


def expected_message(reply: dict, output: str) -> dict:
    """What reading ``output`` must give: the reply, less what the template did not render."""
    reasoning = reply.get("reasoning_content") or reply.get("thinking") or ""
    out = {"content": reply.get("content") or "", "reasoning_content": reasoning if reasoning and reasoning in output else "",
           "tool_calls": [(c["function"]["name"], _args(c["function"]["arguments"])) for c in reply.get("tool_calls", ())]}
    return out


def _args(raw):
    return raw if isinstance(raw, dict) else json.loads(raw)


def read_message(detected: Detected, prompt: str, output: str, *, pieces: list[str] | None = None) -> dict:
    """``output`` read with ``detected`` formats, whole (``pieces`` None) or streamed in ``pieces``;
    the message in the comparable shape of :func:`expected_message`."""
    inside = detected.reasoning.opened_by(prompt) if detected.reasoning is not None else False
    reader = ReplyReader(detected.tool_format, detected.reasoning, inside=inside)
    if pieces is None:
        parsed = reader.read(output)
        return {"content": parsed.content.strip(), "reasoning_content": parsed.reasoning,
                "tool_calls": [(c.name, c.arguments_object()) for c in parsed.calls]}
    stream = StreamReader(reader)
    content, reasoning, calls = [], [], {}
    deltas = [stream.feed(piece) for piece in pieces]
    deltas.append(stream.finish()[0])
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        for call in delta.calls:
            name, args = calls.get(call.index, (None, ""))
            calls[call.index] = (call.name or name, args + call.arguments)
    return {"content": "".join(content).strip(), "reasoning_content": "".join(reasoning),
            "tool_calls": [(name, _loads(args)) for name, args in (calls[i] for i in sorted(calls))]}


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def check(template: str, detected: Detected, *, calls: int = 1, reasoning: bool = True,
          bos: str = "", eos: str = "", kwargs: dict | None = None, stream: str | None = None,
          tokenize=None) -> RoundTrip:
    """The round trip of a reply with ``calls`` calls (0: a plain answer) and reasoning, in the
    first conversation (system and user, or user alone), variables (:data:`TEMPLATE_KWARGS`,
    unless ``kwargs``) and reply shape the template renders. ``stream``: None reads the output
    whole; "chars" feeds it a character at a time, "bytes" a byte at a time; "tokens" feeds it as
    ``tokenize(text) -> list[str]`` pieces it."""
    markers = ()
    if detected.reasoning is not None:
        markers = (detected.reasoning.end, detected.reasoning.start)
    first = None
    for variables in ((kwargs,) if kwargs is not None else TEMPLATE_KWARGS):
        for history in ([SYSTEM, USER], [USER]):
            for reply in assistant_variants(calls, reasoning):
                rendered = model_output(template, reply, bos=bos, eos=eos, kwargs=variables, history=history,
                                        markers=markers)
                if rendered is None:
                    continue
                prompt, output = rendered
                if calls and not all(name in output for name, _, _ in CALLS[:calls]):
                    continue  # the template writes this shape of call as nothing: try the next
                expected = expected_message(reply, output)
                pieces = None if stream is None else _pieces(output, stream, tokenize)
                got = read_message(detected, prompt, output, pieces=pieces)
                setup = _setup(variables, history)
                if got == expected:
                    return RoundTrip(True, output, expected, got, setup)
                first = first or RoundTrip(False, output, expected, got, f"read back differs ({setup})")
    if first is not None:
        return first
    if calls:
        return RoundTrip(False, note="the template renders no call (or not after this conversation)")
    return RoundTrip(False, note="the template renders no reply after this conversation")


def _pieces(output: str, stream: str, tokenize) -> list[str]:
    """``output`` as a stream would deliver it: a character at a time, a byte at a time (the
    text each byte completes, "" while a character is unfinished), or as ``tokenize`` splits it."""
    if stream == "chars":
        return list(output)
    if stream == "bytes":
        decoder = codecs.getincrementaldecoder("utf-8")()
        return [decoder.decode(bytes([b])) for b in output.encode()]
    return tokenize(output)


def _setup(variables: dict, history: list[dict]) -> str:
    """What a round trip needed beyond a system and a user message ("" if nothing)."""
    parts = [] if history[0] is SYSTEM else ["no system message"]
    parts += [f"{k}={'...' if k == 'functions' else v}" for k, v in variables.items()]
    return ", ".join(parts)


def written_call(fmt, function: dict, args: dict) -> str:
    """The text a forced call of ``function`` with ``args`` would be, as the grammar built from
    ``fmt.call_choice`` and ``fmt.call_tail`` lets the model write it (JSON laid out as
    json.dumps writes it; a plain-text value as the string itself)."""
    from superfluid.core.request import is_text

    def fill(choice, value) -> str:
        text = choice.lead
        if is_text(choice.schema):
            text += value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        elif choice.schema is not None:
            text += json.dumps(value, ensure_ascii=False)
        return text

    def write(piece) -> str:
        # a piece written for a parameter names it in its lead; an optional one is left out unless given
        key = next((k for k in args if k in piece.lead), None)
        if piece.optional and key is None:
            return ""
        return fill(piece, args.get(key)) + "".join(write(sub) for sub in piece.rest)

    choice = fmt.call_choice(function)
    text = fill(choice, args) + "".join(write(part) for part in choice.rest)
    return text + fmt.call_tail
