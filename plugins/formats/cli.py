"""``superfluid template``: a model's chat, offline. ``render`` a request's prompt, ``parse`` a
model's raw output into the assistant message, ``show`` which template and formats a model gets,
``list`` what is registered, ``check`` a template's round trip.

It answers with the server's own pieces (the registry every plugin fills, the options' precedence
of :func:`~superfluid.core.formats.setup.chat_setup`, :func:`~superfluid.core.chat.render_chat`,
:class:`~superfluid.core.formats.reader.ReplyReader`), so what it prints is what a served model
does, without loading the weights: ``--model`` reads a GGUF's metadata only. Bad input (JSON that
does not parse, a missing file, an unknown name) is a message on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys

import attrs

from superfluid.core.errors import ConfigError, SuperfluidError
from superfluid.core.formats.registry import AUTO

HELP = "render, parse, show, list and check chat templates and reply formats (offline)"


class CliError(Exception):
    """Bad input: the message goes to stderr and the command exits 2."""


@attrs.frozen
class ModelFacts:
    """What a GGUF's metadata says about its chat (no weights read)."""

    template: str | None = None
    bos_token: str = ""
    eos_token: str = ""


# ---- arguments ---------------------------------------------------------------------------------


def _template_args(parser: argparse.ArgumentParser, parsers: bool = True) -> None:
    parser.add_argument("--chat-template-file", metavar="F",
                        help="a Jinja chat template file (wins over the others)")
    parser.add_argument("--chat-template", metavar="NAME",
                        help="a built-in template by name (`superfluid template list`)")
    parser.add_argument("--model", metavar="M", help="a GGUF: its BOS and EOS text, and its own template "
                                                     "when neither option above is given (metadata only)")
    if parsers:
        parser.add_argument("--tool-call-parser", default=AUTO, metavar="N",
                            help="a tool-call format, 'none' or 'auto'")
        parser.add_argument("--reasoning-parser", default=AUTO, metavar="N",
                            help="a reasoning format, 'none' or 'auto'")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="template_command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text)  # its own --help says it too

    render = command("render", "stdin: a chat body (messages, tools, add_generation_prompt, "
                               "chat_template_kwargs); stdout: the prompt text, nothing added")
    _template_args(render, parsers=False)
    parse = command("parse", "stdin: a model's raw output; stdout: the assistant message "
                             "(OpenAI's shape) as JSON")
    _template_args(parse)
    parse.add_argument("--chat-template-kwargs", metavar="JSON", default="{}",
                       help="template variables for the prompt that decides whether reasoning was opened "
                            "(e.g. '{\"enable_thinking\": false}')")
    show = command("show", "the template a model chats with, where it came from, and its formats")
    _template_args(show)
    show.add_argument("--json", action="store_true", help="one JSON object")
    lister = command("list", "the registered tool-call formats, reasoning formats and named templates")
    lister.add_argument("--json", action="store_true", help="one JSON object")
    check = command("check", "the round trip of one and two calls, read whole and a character at a time")
    _template_args(check)


# ---- the pieces --------------------------------------------------------------------------------


def registry():
    """The formats every installed plugin registers (third parties' too, by entry point)."""
    from superfluid.core.formats.registry import load
    from superfluid.core.plugins import make_plugin_manager

    return load(make_plugin_manager())


def gguf_facts(path: str) -> ModelFacts:
    """A GGUF's chat template and BOS/EOS text, from its metadata header (:mod:`._gguf_meta`)."""
    from ._gguf_meta import chat_facts

    try:
        return ModelFacts(*chat_facts(path))
    except FileNotFoundError:
        raise CliError(f"--model: no such file: {path}") from None
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped; GgufError is a ValueError
        raise CliError(f"--model: cannot read {path} as a GGUF: {exc}") from None


def setup_of(args, formats):
    """(ChatSetup, ModelFacts) for the command's options, with the server's precedence."""
    from superfluid.core.formats.setup import chat_setup

    facts = gguf_facts(args.model) if args.model else ModelFacts()
    return chat_setup(facts.template, formats, template_file=args.chat_template_file,
                      template_name=args.chat_template, tool_parser=getattr(args, "tool_call_parser", AUTO),
                      reasoning_parser=getattr(args, "reasoning_parser", AUTO)), facts


def _needs_template(setup) -> str:
    if setup.template is None:
        raise CliError("no chat template: give --chat-template-file F or --chat-template NAME "
                       "(or --model with a GGUF that has one)")
    return setup.template


def _stdin_json() -> dict:
    try:
        body = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CliError(f"stdin is not JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise CliError("stdin must be a JSON object with a 'messages' list")
    kinds = {"chat_template_kwargs": (dict, "an object"), "tools": (list, "a list"),
             "add_generation_prompt": (bool, "true or false")}
    for key, (kind, what) in kinds.items():
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise CliError(f"{key} must be {what}")
    return body


def _json_arg(text: str, name: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise CliError(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CliError(f"{name} must be a JSON object")
    return value


def _write(text: str) -> None:
    sys.stdout.buffer.write(text.encode("utf-8"))
    sys.stdout.buffer.flush()


# ---- the subcommands ---------------------------------------------------------------------------


def cmd_render(args) -> int:
    from superfluid.core.chat import render_chat

    body = _stdin_json()
    setup, facts = setup_of(args, registry())
    text = render_chat(_needs_template(setup), body["messages"], bos_token=facts.bos_token,
                       eos_token=facts.eos_token, add_generation_prompt=body.get("add_generation_prompt", True),
                       tools=body.get("tools"), **(body.get("chat_template_kwargs") or {}))
    _write(text)
    return 0


def cmd_parse(args) -> int:
    from superfluid.core.chat import render_chat
    from superfluid.core.formats.reader import ReplyReader

    kwargs = _json_arg(args.chat_template_kwargs, "--chat-template-kwargs")
    output = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    setup, facts = setup_of(args, registry())
    detected = setup.detected
    inside = False
    if detected.reasoning is not None and setup.template is not None:
        prompt = render_chat(setup.template, [{"role": "user", "content": "hi"}], bos_token=facts.bos_token,
                             eos_token=facts.eos_token, add_generation_prompt=True, **kwargs)
        inside = detected.reasoning.opened_by(prompt)
    reader = ReplyReader(detected.tool_format, detected.reasoning, inside=inside)
    message = reader.read(output).openai_message()
    _write(json.dumps(message, ensure_ascii=False, indent=2) + "\n")
    return 0


def cmd_show(args) -> int:
    if not (args.model or args.chat_template_file or args.chat_template):
        raise CliError("show: give --model M (and --chat-template-file F or --chat-template NAME to override it)")
    setup, _ = setup_of(args, registry())
    info = {"model": args.model, **setup.describe(), "template": setup.template}
    if args.json:
        _write(json.dumps(info, ensure_ascii=False, indent=2) + "\n")
        return 0
    lines = [f"{key}: {'-' if value is None else value}" for key, value in info.items() if key != "template"]
    lines += ["", setup.template if setup.template is not None else
              "(no chat template: chat requests are refused with 400 chat_template_missing)"]
    _write("\n".join(lines) + "\n")
    return 0


def cmd_list(args) -> int:
    formats = registry()
    table = {"tool_call_parsers": {n: f.description for n, f in sorted(formats.tool_formats.items())},
             "reasoning_parsers": {n: f.description or f"{f.start} ... {f.end}"
                                   for n, f in sorted(formats.reasoning_formats.items())},
             "chat_templates": {n: t.description for n, t in sorted(formats.templates.items())}}
    if args.json:
        _write(json.dumps(table, ensure_ascii=False, indent=2) + "\n")
        return 0
    heads = {"tool_call_parsers": "tool-call parsers (tool-call-parser; also 'auto', 'none')",
             "reasoning_parsers": "reasoning parsers (reasoning-parser; also 'auto', 'none')",
             "chat_templates": "named chat templates (chat-template)"}
    out = []
    for key, entries in table.items():
        out.append(heads[key] + ":")
        width = max((len(n) for n in entries), default=0)
        out += [f"  {name.ljust(width)}  {text}" for name, text in entries.items()]
        out.append("")
    _write("\n".join(out))
    return 0


def cmd_check(args) -> int:
    """Exit 0 when every round trip reads back what was rendered, 1 when one does not."""
    from superfluid.plugins.formats.roundtrip import check

    setup, facts = setup_of(args, registry())
    template = _needs_template(setup)
    results = []
    for calls in (1, 2):
        for stream in (None, "chars"):
            trip = check(template, setup.detected, calls=calls, bos=facts.bos_token, eos=facts.eos_token,
                         stream=stream)
            results.append({"calls": calls, "read": stream or "whole", **attrs.asdict(trip)})
    report = {**setup.describe(), "ok": all(r["ok"] for r in results), "results": results}
    _write(json.dumps(report, ensure_ascii=False, indent=2) + "\n")
    return 0 if report["ok"] else 1


COMMANDS = {"render": cmd_render, "parse": cmd_parse, "show": cmd_show, "list": cmd_list, "check": cmd_check}


def run(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.template_command](args)
    except (CliError, ConfigError, SuperfluidError) as exc:
        print(f"superfluid template {args.template_command}: {exc}", file=sys.stderr)
        return 2
