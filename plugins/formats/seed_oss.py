"""ByteDance Seed-OSS: ``<seed:tool_call>`` around ``<function=NAME>`` with one
``<parameter=K>V</parameter>`` per argument, one section per call; reasoning in
``<seed:think>...</seed:think>``.

Like Qwen3-Coder's syntax but wrapped in ``<seed:tool_call>``, so detection prefers this format
on Seed templates. The template writes a non-string value with Jinja's ``| string`` (Python's
``str``: ``True``, ``{'a': 1}``), so a value that is neither JSON nor text is read as a Python
literal."""

from __future__ import annotations

import ast
import json

from superfluid.core.formats.family import ReasoningFormat

from ._tagged import TaggedParams, text_or_json

SECTION_OPEN, SECTION_CLOSE = "<seed:tool_call>", "</seed:tool_call>"

SEED_THINK = ReasoningFormat("seed-think", "<seed:think>", "</seed:think>",
                             "<seed:think>...</seed:think> (ByteDance Seed-OSS)")


def python_or_text(raw: str):
    """JSON, else a Python literal that is a JSON value (``True``, ``{'a': None}``), else text."""
    value = text_or_json(raw)
    if value is not raw:
        return value
    try:
        value = ast.literal_eval(raw.strip())
        json.dumps(value, allow_nan=False)
    except Exception:  # noqa: BLE001 - not a literal (or not one JSON can carry): the text it is
        return raw
    return raw if isinstance(value, (str, bytes)) else value


class SeedOss(TaggedParams):
    name = "seed-oss"
    description = "<seed:tool_call><function=NAME><parameter=K>V</parameter></function></seed:tool_call> (Seed-OSS)"
    reasoning = SEED_THINK.name
    section_open, section_close = SECTION_OPEN, SECTION_CLOSE
    call_open, head_end, call_close = "<function=", ">", "</function>"
    param_open, param_head_end, value_close = "<parameter=", ">", "</parameter>"
    call_tail = f"\n</function>\n{SECTION_CLOSE}"
    call_stop = "</function>"

    def detect(self, template: str) -> int:
        return 30 if SECTION_OPEN in template else 0

    def value(self, raw: str, is_string):
        return raw if is_string else python_or_text(raw)

    def call_lead_text(self, name: str) -> str:
        return f"{SECTION_OPEN}\n<function={name}>"

    def param_lead(self, key: str, is_string: bool) -> str:
        return f"\n<parameter={key}>"


FORMATS = (SeedOss(), SEED_THINK)
