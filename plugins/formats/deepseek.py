"""DeepSeek: three call syntaxes over the model generations, all in a ``<think>`` family.

* R1 (and its distills, and V3-0324): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
  then the arguments in a ```json fence, ``<｜tool▁call▁end｜>``, calls separated by newlines, then
  ``<｜tool▁calls▁end｜>``.
* V3.1: the same section and call markers, but ``NAME<｜tool▁sep｜>{json}`` with no type and no fence.
* V3.2: "DSML" tags, ``<｜DSML｜function_calls>`` around ``<｜DSML｜invoke name="NAME">`` with one
  ``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` per argument: the
  ``string`` attribute says whether V is raw text or JSON, so no guessing is needed.

R1 and V3.1 templates are told apart by R1's fence (```json in the template)."""

from __future__ import annotations

import json
import re

from superfluid.core.formats.jsonscan import skip_ws

from ._tagged import MarkedJson, TaggedParams

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekR1(MarkedJson):
    name = "deepseek-r1"
    description = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME ```json{...}```<｜tool▁call▁end｜> "
                   "(DeepSeek R1, its distills, V3-0324)")
    reasoning = "think"
    section_open, section_close, call_open = CALLS_BEGIN, CALLS_END, CALL_BEGIN
    args_open, call_close, fence = "\n", CALL_END, FENCE
    call_tail = "\n" + FENCE + CALL_END + CALLS_END
    call_stop = CALL_END

    def detect(self, template: str) -> int:
        return 25 if SEP in template and FENCE + "json" in template else 0

    def read_head(self, head: str):
        kind, sep, name = head.partition(SEP)
        name = name.strip()
        return (name, None) if sep and name else None

    def args_start(self, text: str, pos: int, partial: bool):
        """After the name's line, the ```json fence (optional: a model may leave it out)."""
        pos = skip_ws(text, pos)
        rest = text[pos:]
        if partial and len(rest) < len(FENCE + "json") and (FENCE + "json").startswith(rest):
            return None
        if rest.startswith(FENCE):
            pos += len(FENCE) + (len("json") if rest.startswith(FENCE + "json") else 0)
        return pos

    def call_lead(self, name: str) -> str:
        return f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{name}\n{FENCE}json\n"


class DeepSeekV31(MarkedJson):
    name = "deepseek-v3.1"
    description = "<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜> (DeepSeek V3.1)"
    reasoning = "think"
    section_open, section_close, call_open = CALLS_BEGIN, CALLS_END, CALL_BEGIN
    args_open, call_close = SEP, CALL_END
    call_tail = CALL_END + CALLS_END
    call_stop = CALL_END

    def detect(self, template: str) -> int:
        return 25 if SEP in template and CALL_BEGIN in template and FENCE + "json" not in template else 0

    def call_lead(self, name: str) -> str:
        return f"{CALLS_BEGIN}{CALL_BEGIN}{name}{SEP}"


DSML = "｜DSML｜"
_STRING_ATTR = re.compile(r'\bstring="(true|false)"')


class DeepSeekV32(TaggedParams):
    name = "deepseek-v3.2"
    description = ('<｜DSML｜function_calls><｜DSML｜invoke name="NAME">'
                   '<｜DSML｜parameter name="K" string="true|false">V... (DeepSeek V3.2)')
    reasoning = "think"
    section_open, section_close = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
    call_open, head_end, call_close = f'<{DSML}invoke name="', '">', f"</{DSML}invoke>"
    param_open, param_head_end, value_close = f'<{DSML}parameter name="', ">", f"</{DSML}parameter>"
    call_tail = f"\n{call_close}\n{section_close}"
    call_stop = call_close

    def detect(self, template: str) -> int:
        return 30 if DSML in template else 0

    def param_key(self, head: str):
        """``K" string="true"``: the key up to its closing quote, and the string attribute."""
        key, quote, rest = head.partition('"')
        flag = _STRING_ATTR.search(rest)
        return (key, None if flag is None else flag.group(1) == "true") if key and quote else None

    def call_lead_text(self, name: str) -> str:
        return f'{self.section_open}\n{self.call_open}{name}">'

    def param_lead(self, key: str, is_string: bool) -> str:
        return f'\n{self.param_open}{key}" string="{json.dumps(is_string)}">'


FORMATS = (DeepSeekR1(), DeepSeekV31(), DeepSeekV32())
