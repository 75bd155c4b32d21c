"""docs/formats.md's table: every template of a folder (default ../shared/templates) rendered by
superfluid and by transformers' ``apply_chat_template`` (byte for byte, for a conversation with a
system message, tools and a user turn), the formats detected, and the round trip of a reply with
reasoning and one call, then two parallel calls: read whole, fed a byte at a time, and fed
as the default model's (SmolLM2's) tokens.

    python -m tools.formats.table [--dir DIR] [--markdown]
"""

from __future__ import annotations

import argparse
import codecs
import json
import pathlib

from superfluid.core.chat import render_chat
from superfluid.plugins.formats import roundtrip

from .check import DEFAULT_DIR, registry

CONVERSATION = [roundtrip.SYSTEM, roundtrip.USER]


def transformers_render(template: str, messages: list[dict], tools: list[dict] | None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                        add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    return rendered[0]


def render_equality(template: str) -> str:
    """"yes", or why not: the same conversation (system, tools, user) rendered by both."""
    for messages, what in ((CONVERSATION, ""), ([roundtrip.USER], " (no system message)")):
        try:
            theirs = transformers_render(template, messages, roundtrip.TOOLS)
        except Exception as exc:  # noqa: BLE001 - the template refuses this conversation
            theirs_error = f"{type(exc).__name__}: {exc}"
            theirs = None
        try:
            ours = render_chat(template, messages, tools=roundtrip.TOOLS, bos_token="<s>", eos_token="</s>",
                               add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001
            ours = None
            ours_error = str(exc)
        if theirs is None and ours is None:
            if messages is CONVERSATION:
                continue
            return f"both refuse: {theirs_error[:80]}"
        if theirs is None or ours is None:
            return f"differs: {'transformers' if theirs is None else 'superfluid'} refuses: " \
                   f"{(theirs_error if theirs is None else ours_error)[:80]}"
        return ("yes" + what) if ours == theirs else f"differs{what}"
    return "no"


def why_not(template: str, calls: int, one_call_ok: bool) -> str:
    """Why a template shows no call to read back."""
    if calls == 2 and one_call_ok:
        return "renders one call per turn"
    reply = next(roundtrip.assistant_variants(calls, False))
    try:
        render_chat(template, [roundtrip.USER, reply], tools=roundtrip.TOOLS, add_generation_prompt=False)
    except Exception as exc:  # noqa: BLE001 - the template refuses
        return f"refuses the call turn: {str(exc)[:70]}"
    return "renders an assistant's calls as nothing"


def token_pieces():
    """A function splitting text into the default model's tokens' texts, as a stream decodes them."""
    from superfluid.core.default_model import default_model_path
    from superfluid.plugins.vocab import GGUFVocab

    vocab = GGUFVocab(default_model_path(), "smollm2")

    def pieces(text: str) -> list[str]:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out = [decoder.decode(vocab.piece(t, special=True)) for t in vocab.tokenize(text, False, True)]
        out.append(decoder.decode(b"", final=True))
        assert "".join(out) == text, "the tokens do not spell the text"
        return out

    return pieces


def rows(folder: pathlib.Path):
    reg, pieces = registry(), token_pieces()
    for path in sorted(folder.glob("*.jinja")):
        template = path.read_text()
        detected = reg.resolve(template)
        row = {"template": path.stem, "render": render_equality(template),
               "tool_format": detected.tool_format.name if detected.tool_format else "-",
               "reasoning": detected.reasoning.name if detected.reasoning else "-"}
        for calls in (1, 2):
            whole = roundtrip.check(template, detected, calls=calls)
            if not whole.output:
                row[f"calls{calls}"] = "n/a"
                row[f"note{calls}"] = why_not(template, calls, row.get("calls1", "n/a") != "n/a")
                continue
            chars = roundtrip.check(template, detected, calls=calls, stream="bytes")
            tokens = roundtrip.check(template, detected, calls=calls, stream="tokens", tokenize=pieces)
            row[f"calls{calls}"] = "/".join("ok" if r.ok else "FAIL" for r in (whole, chars, tokens))
            row[f"note{calls}"] = whole.note
        yield row


def markdown(table: list[dict]) -> str:
    head = ("| template | render = transformers | tool calls | reasoning | 1 call: whole/chars/tokens "
            "| 2 calls: whole/chars/tokens | needs |")
    lines = [head, "|" + "---|" * 7]
    for r in table:
        need = "; ".join(dict.fromkeys(n for n in (r.get("note1", ""), r.get("note2", "")) if n))
        lines.append(f"| {r['template']} | {r['render']} | {r['tool_format']} | {r['reasoning']} | "
                     f"{r['calls1']} | {r['calls2']} | {need} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=str(DEFAULT_DIR))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    table = list(rows(pathlib.Path(args.dir)))
    print(markdown(table) if args.markdown else json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
