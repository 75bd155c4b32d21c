"""Built-in chat templates by name (``chat-template NAME``), as llama-server's ``--chat-template``
names them: for a GGUF that carries no template (a base model's conversion, an old export), or
one whose template is broken.

They are written here, one small Jinja template per format, from the formats' role markers: what
each writes around a system, user and assistant turn, and the generation prompt that opens the
assistant's reply. Two rules keep them honest:

- the end of a turn that *is* the model's EOS token (Llama 2, Mistral, Zephyr, Vicuna) is written
  as ``eos_token``, and a BOS the format opens with as ``bos_token``, so that the model's own
  tokens are used (the server passes them; ``superfluid template render`` passes "" without
  ``--model``); markers that are special tokens of their own (``<|im_end|>``) are literal;
- the assistant's turn opens exactly as the generation prompt does (or with it and a space), so
  a conversation's prompt is a prefix of the next turn's and the prefix cache serves it.

They render no ``tools``: a request with tools gets them described in a system message and its
calls and results written as text (plugins/http/prepare/tool_render.py), and its replies read
with the format of the ``tool-call-parser`` option. A role a format has no marker for (``tool``)
is refused by the template, which is how the preparer learns to write it as text."""

from __future__ import annotations

import json

from superfluid.core.formats.setup import NamedTemplate


class _Var(str):
    """A template variable (``bos_token``, ``eos_token``) among literal text."""


BOS, EOS = _Var("bos_token"), _Var("eos_token")

# a message's text: a string, or the text parts of a list of content parts
_TEXT = ("{%- macro text(c) -%}"
         "{%- if c is string -%}{{ c }}"
         "{%- elif c is iterable and c is not mapping -%}"
         "{%- for p in c -%}{%- if p is mapping and p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}"
         "{%- endif -%}"
         "{%- endmacro -%}\n")
_NO_ROLE = "{%- else -%}{{ raise_exception('this chat template has no role ' ~ m.role) }}{%- endif -%}\n"


def _out(*parts: str) -> str:
    """Jinja that writes ``parts`` (literal text, or :data:`BOS` / :data:`EOS`) as they are."""
    parts = tuple(p for p in parts if p)
    if not parts:
        return ""
    return "{{ " + " ~ ".join(p if isinstance(p, _Var) else json.dumps(p, ensure_ascii=False)
                              for p in parts) + " }}"


def _content(trim: bool) -> str:
    return "{{ text(m.content) | trim }}" if trim else "{{ text(m.content) }}"


def marked(roles: dict[str, tuple[tuple, tuple]], generation: tuple, *, bos: bool = False,
           trim: bool = False) -> str:
    """A format that writes every turn between markers of its role: ``roles`` maps a role to
    (what opens its turn, what closes it), each a tuple of :func:`_out` parts."""
    out = [_TEXT, "{{- bos_token -}}\n" if bos else "", "{%- for m in messages -%}\n"]
    for i, (role, (opening, closing)) in enumerate(roles.items()):
        out.append(f"{{%- {'if' if i == 0 else 'elif'} m.role == {json.dumps(role)} -%}}"
                   f"{_out(*opening)}{_content(trim)}{_out(*closing)}\n")
    out += [_NO_ROLE, "{%- endfor -%}\n", "{%- if add_generation_prompt -%}", _out(*generation), "{%- endif -%}"]
    return "".join(out)


def merged(user: tuple[tuple, tuple], assistant: tuple[tuple, tuple], generation: tuple,
           system: tuple[tuple, tuple], *, bos: str = "once", trim: bool = False) -> str:
    """A format without a system turn: a leading system message is written into the first user
    turn, between ``system``'s two parts (a later one is written as a user turn). ``bos``:
    "once" at the start, "user" before every user turn (Llama 2), "" never."""
    (u_open, u_close), (a_open, a_close), (s_open, s_close) = user, assistant, system
    content = _content(trim)
    sys_content = "{{ text(messages[0].content) | trim }}" if trim else "{{ text(messages[0].content) }}"
    user_bos = _out(BOS) if bos == "user" else ""
    return "".join([
        _TEXT,
        "{%- set ns = namespace(system=false) -%}\n",
        "{%- if messages and messages[0].role == 'system' -%}{%- set ns.system = true -%}{%- endif -%}\n",
        "{{- bos_token -}}\n" if bos == "once" else "",
        "{%- for m in messages -%}\n",
        "{%- if loop.first and ns.system -%}\n",
        "{%- elif m.role in ('user', 'system') -%}",
        user_bos, _out(*u_open),
        "{%- if ns.system -%}", _out(*s_open), sys_content, _out(*s_close),
        "{%- set ns.system = false -%}{%- endif -%}",
        content, _out(*u_close), "\n",
        "{%- elif m.role == 'assistant' -%}", _out(*a_open), content, _out(*a_close), "\n",
        _NO_ROLE, "{%- endfor -%}\n",
        "{%- if add_generation_prompt -%}", _out(*generation), "{%- endif -%}"])


def _same(opening: str, closing: tuple, roles=("system", "user", "assistant")) -> dict:
    """Each role's turn opened by ``opening`` with ``{role}`` in it, all closed alike."""
    return {role: ((opening.format(role=role),), closing) for role in roles}


def _mistral(user_open: str, user_close: str, reply_open: str) -> str:
    """Mistral v1 and v3 (and v3's Tekken form, without the spaces): ``[INST] user [/INST] reply</s>``,
    the system prompt opening the first user turn."""
    return merged(((user_open,), (user_close,)), ((reply_open,), (EOS,)), (), (("",), ("\n\n",)))


CHATML = NamedTemplate("chatml", marked(
    _same("<|im_start|>{role}\n", ("<|im_end|>\n",)), ("<|im_start|>assistant\n",)),
    "ChatML, <|im_start|>role … <|im_end|> (Qwen 1.5-2.5, Yi, Hermes, SmolLM, many fine-tunes)")

LLAMA2 = NamedTemplate("llama2", merged(
    (("[INST] ",), (" [/INST]",)), ((" ",), (" ", EOS)), (), (("<<SYS>>\n",), ("\n<</SYS>>\n\n",)),
    bos="user", trim=True),
    "Llama 2 chat: <s>[INST] <<SYS>>…<</SYS>> user [/INST] reply </s>")

LLAMA3 = NamedTemplate("llama3", marked(
    _same("<|start_header_id|>{role}<|end_header_id|>\n\n", ("<|eot_id|>",)),
    ("<|start_header_id|>assistant<|end_header_id|>\n\n",), bos=True, trim=True),
    "Llama 3, 3.1, 3.2, 3.3: <|start_header_id|>role<|end_header_id|> … <|eot_id|>")

LLAMA4 = NamedTemplate("llama4", marked(
    _same("<|header_start|>{role}<|header_end|>\n\n", ("<|eot|>",)),
    ("<|header_start|>assistant<|header_end|>\n\n",), bos=True, trim=True),
    "Llama 4: <|header_start|>role<|header_end|> … <|eot|>")

MISTRAL_V1 = NamedTemplate("mistral-v1", _mistral(" [INST] ", " [/INST]", " "),
                           "Mistral 7B Instruct v0.1, Mixtral 8x7B: <s> [INST] user [/INST] reply</s>")
MISTRAL_V3 = NamedTemplate("mistral-v3", _mistral("[INST] ", "[/INST]", " "),
                           "Mistral 7B Instruct v0.3, Mixtral 8x22B, Codestral: <s>[INST] user[/INST] reply</s>")
MISTRAL_V3_TEKKEN = NamedTemplate("mistral-v3-tekken", _mistral("[INST]", "[/INST]", ""),
                                  "Mistral Nemo and other Tekken models: <s>[INST]user[/INST]reply</s>")


def _mistral_v7(space: str) -> str:
    return marked({"system": (("[SYSTEM_PROMPT]" + space,), ("[/SYSTEM_PROMPT]",)),
                   "user": (("[INST]" + space,), ("[/INST]",)),
                   "assistant": ((space,), (EOS,))}, (), bos=True)


MISTRAL_V7 = NamedTemplate("mistral-v7", _mistral_v7(" "), "Mistral Large 2411, Pixtral Large: "
                           "[SYSTEM_PROMPT] … [/SYSTEM_PROMPT][INST] user[/INST] reply</s>")
MISTRAL_V7_TEKKEN = NamedTemplate("mistral-v7-tekken", _mistral_v7(""),
                                  "Mistral Small 3.x: [SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]user[/INST]reply</s>")

PHI3 = NamedTemplate("phi3", marked(_same("<|{role}|>\n", ("<|end|>\n",)), ("<|assistant|>\n",)),
                     "Phi-3, Phi-3.5: <|role|> … <|end|>")

PHI4 = NamedTemplate("phi4", marked(_same("<|im_start|>{role}<|im_sep|>", ("<|im_end|>",)),
                                    ("<|im_start|>assistant<|im_sep|>",)),
                     "Phi-4: <|im_start|>role<|im_sep|> … <|im_end|>")

GEMMA = NamedTemplate("gemma", merged(
    (("<start_of_turn>user\n",), ("<end_of_turn>\n",)), (("<start_of_turn>model\n",), ("<end_of_turn>\n",)),
    ("<start_of_turn>model\n",), (("",), ("\n\n",)), trim=True),
    "Gemma 1, 2, 3: <bos><start_of_turn>user … <end_of_turn> (the system prompt opens the first user turn)")

ZEPHYR = NamedTemplate("zephyr", marked(_same("<|{role}|>\n", (EOS, "\n")), ("<|assistant|>\n",)),
                       "Zephyr: <|role|> … </s>")

VICUNA = NamedTemplate("vicuna", marked(
    {"system": (("",), ("\n\n",)), "user": (("USER: ",), ("\n",)), "assistant": (("ASSISTANT: ",), (EOS, "\n"))},
    ("ASSISTANT:",)),
    "Vicuna 1.1: system, USER: … ASSISTANT: …</s>")

DEEPSEEK = NamedTemplate("deepseek", marked(
    {"system": (("",), ("\n",)), "user": (("### Instruction:\n",), ("\n",)),
     "assistant": (("### Response:\n",), ("\n<|EOT|>\n",))}, ("### Response:\n",), bos=True),
    "DeepSeek Coder, DeepSeek LLM: ### Instruction: … ### Response: … <|EOT|>")

DEEPSEEK3 = NamedTemplate("deepseek3", marked(
    {"system": (("",), ("",)), "user": (("<｜User｜>",), ("",)),
     "assistant": (("<｜Assistant｜>",), ("<｜end▁of▁sentence｜>",))}, ("<｜Assistant｜>",), bos=True),
    "DeepSeek V3, R1: <｜User｜>…<｜Assistant｜>…<｜end▁of▁sentence｜>")

COMMAND_R = NamedTemplate("command-r", marked(
    {role: ((f"<|START_OF_TURN_TOKEN|><|{token}|>",), ("<|END_OF_TURN_TOKEN|>",))
     for role, token in (("system", "SYSTEM_TOKEN"), ("user", "USER_TOKEN"), ("assistant", "CHATBOT_TOKEN"))},
    ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",), bos=True),
    "Command R, R+, R7B: <|START_OF_TURN_TOKEN|><|ROLE_TOKEN|> … <|END_OF_TURN_TOKEN|>")

GRANITE = NamedTemplate("granite", marked(
    _same("<|start_of_role|>{role}<|end_of_role|>", ("<|end_of_text|>\n",)),
    ("<|start_of_role|>assistant<|end_of_role|>",)),
    "Granite 3.x: <|start_of_role|>role<|end_of_role|> … <|end_of_text|>")

OPENCHAT = NamedTemplate("openchat", marked(
    {"system": (("",), ("<|end_of_turn|>",)), "user": (("GPT4 Correct User: ",), ("<|end_of_turn|>",)),
     "assistant": (("GPT4 Correct Assistant: ",), ("<|end_of_turn|>",))}, ("GPT4 Correct Assistant:",), bos=True),
    "OpenChat 3.5: GPT4 Correct User: … <|end_of_turn|>GPT4 Correct Assistant: …")

FALCON3 = NamedTemplate("falcon3", marked(_same("<|{role}|>\n", ("\n",)), ("<|assistant|>\n",)),
                        "Falcon 3: <|role|> then the text on the next line")

FORMATS = (CHATML, LLAMA2, LLAMA3, LLAMA4, MISTRAL_V1, MISTRAL_V3, MISTRAL_V3_TEKKEN, MISTRAL_V7,
           MISTRAL_V7_TEKKEN, PHI3, PHI4, GEMMA, ZEPHYR, VICUNA, DEEPSEEK, DEEPSEEK3, COMMAND_R, GRANITE,
           OPENCHAT, FALCON3)
